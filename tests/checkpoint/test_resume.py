"""Opening ``train.output_dir``: an output folder the OS refuses is a one-line CheckpointError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r1fit.checkpoint.manager import CheckpointError
from r1fit.checkpoint.resume import open_output_dir
from r1fit.config import load_config


def _open(out: Path, *overrides: str):
    return open_output_dir(load_config(None, [f"train.output_dir={out}", *overrides]), "grpo")


def test_a_fresh_folder_is_created(tmp_path: Path) -> None:
    out, resume = _open(tmp_path / "a" / "run")
    assert out.is_dir() and resume is None


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_folder_below_a_regular_file_is_one_line(tmp_path: Path, resume: str) -> None:
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    out = blocker / "runs" / "demo"
    with pytest.raises(CheckpointError) as info:
        _open(out, f"checkpoint.resume={resume}")
    assert str(info.value) == (f"train.output_dir={out}: cannot create or use the output folder: "
                               f"{blocker} is a file, not a folder; choose another "
                               "train.output_dir")


def test_a_regular_file_as_the_folder_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.write_text("")
    with pytest.raises(CheckpointError, match=rf"^train\.output_dir={out}: cannot create or use "
                                              rf"the output folder: {out} is a file, not a folder"):
        _open(out)


def test_other_os_errors_name_the_path_and_the_reason(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)  # tests run as root, where chmod stops nothing
    out = tmp_path / "run"
    with pytest.raises(CheckpointError) as info:
        _open(out)
    assert str(info.value) == (f"train.output_dir={out}: cannot create or use the output folder: "
                               f"{out}: Permission denied; choose another train.output_dir")
    assert isinstance(info.value.__cause__, PermissionError)


def test_the_run_config_is_written_and_a_failed_write_is_one_line(tmp_path: Path) -> None:
    out, _ = _open(tmp_path / "run")
    assert json.loads((out / "config.json").read_text())["kind"] == "grpo"
    # a folder that cannot take the file (as root, a read-only folder would still take it)
    other = tmp_path / "other"
    (other / "config.json").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=rf"^train\.output_dir={other}: cannot create or use "
                                              r"the output folder: .*config\.json"):
        _open(other)
