"""One run per output folder (r1fit/checkpoint/lock.py): a folder another process holds is
refused in one line naming that process, the lock goes with its process however it ends, and a
process may run again in a folder it holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from r1fit.checkpoint.lock import LOCK, hold_output_dir, release_output_dir
from r1fit.checkpoint.manager import CheckpointError
from r1fit.cli import main

HOLDER = """
import sys, time
from pathlib import Path
from r1fit.checkpoint.lock import hold_output_dir
hold_output_dir(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def holder(out: Path) -> subprocess.Popen:
    """Another process holding ``out``, once it has said so."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_folder_another_process_holds_is_refused_until_that_process_dies(tmp_path) -> None:
    out = tmp_path / "run"
    other = holder(out)
    try:
        with pytest.raises(CheckpointError, match=(
                rf"^train.output_dir={out} is in use by another r1fit run \(pid {other.pid} on "
                r".+, since .+\); wait for it to end, or choose another train.output_dir$")):
            hold_output_dir(out)
    finally:
        os.kill(other.pid, signal.SIGKILL)  # as a crash or kill -9 ends a run
        other.wait()
    assert (out / LOCK).is_file()  # the file stays; the lock went with the process
    hold_output_dir(out)
    hold_output_dir(out)  # again in this process: it holds it already
    assert f"pid {os.getpid()} on " in (out / LOCK).read_text()
    release_output_dir(out)
    release_output_dir(out)  # nothing left to release


def test_a_file_system_without_locks_warns_and_runs_unguarded(tmp_path, monkeypatch,
                                                               caplog) -> None:
    import errno
    import logging

    from r1fit.checkpoint import lock

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="r1fit.checkpoint"):
        hold_output_dir(out)
    assert caplog.records[-1].getMessage() == (
        f"train.output_dir={out}: cannot lock it (No locks available): nothing stops a second "
        "run from writing the same folder")


def test_r1fit_train_in_a_folder_a_running_run_holds_stops_in_one_line(use_tiny_cache, tmp_path,
                                                                       capsys) -> None:
    """Before, the second run resumed from the first's newest checkpoint and deleted the one it
    was saving: the first died mid-save."""
    out = tmp_path / "run"
    other = holder(out)
    try:
        assert main(["train", f"train.output_dir={out}", "train.max_steps=1"]) == 2
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"r1fit: error: train.output_dir={out} is in use by another r1fit "
                              f"run (pid {other.pid} on ")
    assert [p.name for p in out.iterdir()] == [LOCK]  # nothing else was written
