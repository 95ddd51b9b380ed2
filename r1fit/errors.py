"""The one error base class: what r1fit raises for a cause the user can fix (a bad config key, a
corrupt file, a run that cannot resume). The CLI prints any :class:`R1fitError` as one line
``r1fit: error: <message>`` and exits with 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager


class R1fitError(Exception):
    """A cause the user can fix; the message names the culprit and what to do."""


def one_line(exc: BaseException, limit: int | None = None, *, first_line: bool = False) -> str:
    """An exception's message folded onto one line (its type name when it has none); with
    ``first_line`` only its first line (CUDA's out-of-memory text continues with allocator
    statistics), cut to ``limit`` characters when given."""
    try:
        text = str(exc).strip()
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises is still one line
        text = ""
    if first_line:
        text = text.splitlines()[0] if text else ""
    text = re.sub(r"\s+", " ", text).strip()
    return text[:limit] if text else type(exc).__name__


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """An OS error inside that names no file (a flush, an image library's write) is raised
    again naming ``path``: a full disk then says which file it stopped."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or one_line(exc), os.fspath(path)) from exc
        raise
