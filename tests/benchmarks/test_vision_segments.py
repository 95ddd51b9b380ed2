"""benchmarks/vision_segments.py on a small case: it runs both settings on the shipped
Qwen2.5-VL-3B vision config, counts one attention call per window (or image) against one a
layer, finds the outputs equal, and its verdict follows the target."""

from __future__ import annotations

import json

import vision_segments
from benchkit import result_prefix


def result(capsys, *argv: str) -> tuple[int, dict]:
    status = vision_segments.run(vision_segments.parse_args(list(argv)))
    line = next(s for s in capsys.readouterr().out.splitlines()
                if s.startswith(result_prefix(vision_segments.NAME)))
    return status, json.loads(line.removeprefix(result_prefix(vision_segments.NAME)))


def test_a_small_case_counts_the_calls_and_judges_the_target(capsys):
    small = ("--images", "2", "--image-px", "224", "--hidden", "16", "--heads", "2",
             "--intermediate", "32", "--repeats", "1")
    status, got = result(capsys, *small, "--min-speedup", "0")
    # 224 px: 16 x 16 patches, 4 windows of 8 x 8 an image; 28 windowed layers, 4 full ones
    assert got["calls"] == {"sdpa": 28 * 2 * 4 + 4 * 2, "r1fit_flash_layout_sdpa": 32}
    assert got["difference"] < 1e-5 and status == 0 and got["met"]
    assert all(len(times) == 1 for times in got["seconds"].values())
    status, got = result(capsys, *small, "--min-speedup", "1000")
    assert status == 1 and not got["met"]
