"""One run per output folder: ``train.output_dir/.r1fit.lock``, an exclusive ``flock`` held by
the process that writes the folder (rank 0) for the rest of its life.

Two runs writing one folder corrupt each other: the second "resumes" from the first's newest
checkpoint, deletes the checkpoint the first is saving, and both append to ``metrics.jsonl``
(measured: the first then died mid-save). The operating system drops the lock when its process
ends, however it ends (``kill -9`` and a crash included), so a stale lock file never blocks a
resume; the file's text only names the holder for the error message. A lock is per process and
per folder: a process that runs again in a folder it holds (tests, notebooks) keeps its lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from r1fit.checkpoint.manager import CheckpointError

LOCK = ".r1fit.lock"
log = logging.getLogger("r1fit.checkpoint")

#: the folders this process holds (resolved path -> the locked file descriptor)
_held: dict[Path, int] = {}


def hold_output_dir(out: Path) -> None:
    """Lock ``out`` (created if missing) for this process, or raise ``CheckpointError`` naming
    the process that holds it."""
    out.mkdir(parents=True, exist_ok=True)
    key = out.resolve()
    if key in _held:
        return
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process holds it
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise CheckpointError(f"train.output_dir={out} is in use by another r1fit run ({holder}); "
                              "wait for it to end, or choose another train.output_dir") from None
    except OSError as exc:  # a file system without locks (some network ones): run unguarded
        os.close(fd)
        log.warning("train.output_dir=%s: cannot lock it (%s): nothing stops a second run from "
                    "writing the same folder", out, exc.strerror or exc)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _held[key] = fd


def release_output_dir(out: Path) -> None:
    """Give up this process's lock on ``out`` (a no-op where it holds none): the run ended."""
    fd = _held.pop(out.resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock
