"""A rich progress bar on a terminal; periodic log lines otherwise (CI logs, files)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from r1fit.processes import world

log = logging.getLogger("r1fit")


@contextmanager
def progress_bar(title: str, total: int, completed: int = 0) -> Iterator[Callable[..., None]]:
    """Yields ``advance(status="")``, to be called once per step; ``completed`` steps were done
    before (a resumed run)."""
    if not world().main:  # one bar, rank 0's
        yield lambda status="": None
        return
    if sys.stderr.isatty():
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task(title, total=total, completed=completed, status="")
            yield lambda status="": progress.update(task, advance=1, status=status)
        return
    done = completed
    every = max(1, total // 20)

    def advance(status: str = "") -> None:
        nonlocal done
        done += 1
        if done % every == 0 or done == total:
            log.info("%s %d/%d %s", title, done, total, status)

    yield advance
