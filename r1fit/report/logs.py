"""Where a run's log lines go: the terminal (rich when it is one) and ``<output_dir>/log.txt``."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

from r1fit.processes import world

_MARK = "_r1fit"  # handlers r1fit added, replaced by the next setup_logging


def setup_logging(out: Path | None) -> None:
    """Log to the terminal and, with ``out``, to ``out/log.txt``. Ranks other than 0 say only
    warnings and errors, prefixed with their rank."""
    root = logging.getLogger("r1fit")
    w = world()
    root.setLevel(logging.INFO if w.main else logging.WARNING)
    for handler in list(root.handlers):
        if getattr(handler, _MARK, False):
            root.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = []
    if out is not None:
        handlers.append(logging.FileHandler(out / "log.txt"))
        handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                                   "%(message)s"))
    if sys.stderr.isatty() and w.main:
        from rich.logging import RichHandler

        term: logging.Handler = RichHandler(show_path=False)
    else:
        term = logging.StreamHandler()
        rank = f"[rank {w.rank}] " if w.distributed else ""
        term.setFormatter(logging.Formatter(f"{rank}%(levelname)s %(name)s: %(message)s"))
    for handler in (*handlers, term):
        setattr(handler, _MARK, True)
        root.addHandler(handler)


class EarlyLog:
    """Keeps what is logged before ``log.txt`` exists (choosing the output folder and the resume
    point), to be written into it once it does."""

    def __init__(self) -> None:
        self.buffer = logging.handlers.BufferingHandler(capacity=10_000)

    def __enter__(self) -> EarlyLog:
        logging.getLogger("r1fit").addHandler(self.buffer)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("r1fit").removeHandler(self.buffer)

    def replay_to_file(self) -> None:
        for record in self.buffer.buffer:
            for handler in logging.getLogger("r1fit").handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.handle(record)
