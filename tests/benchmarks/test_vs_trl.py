"""benchmarks/vs_trl.py: its argument checks and verdicts on hand-made settings, and one real
side-by-side run of r1fit and TRL's GRPOTrainer on builtin:tiny (TRL from the ``bench`` extra)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from benchkit import load_script
from transformers import AutoModelForImageTextToText

from r1fit.models.load import resolve_model_path

vt = load_script("vs_trl")
MIB = 2**20


def _run(tps: float, peak_mib: float, length: float = 64.0,
         other: float | None = 0.0) -> object:
    return vt.RunResult(tokens_per_second=[tps, tps], completion_len_mean=length,
                        peak_over_load=int(peak_mib * MIB), other_cpu=other, seconds=10.0)


def _settings(r1fit: list, trl: list, g: int = 16) -> dict:
    return {("r1fit", g): vt.Setting("r1fit", g, r1fit), ("trl", g): vt.Setting("trl", g, trl)}


def test_bad_arguments_are_refused(refused):
    assert "multiple of --micro-batch 4, got [6]" in refused(vt.parse_args,
                                                            ["--generations", "8", "6"])
    assert "need >= 2" in refused(vt.parse_args, ["--steps", "1"])
    assert "multiple of 28 px" in refused(vt.parse_args, ["--image-size", "100"])


def test_targets_at_the_largest_group_use_the_medians():
    # medians: r1fit 30 tokens/s and 300 MiB, TRL 9 tokens/s and 600 MiB -> 3.33x, 0.50x
    settings = _settings([_run(30, 300), _run(20, 310), _run(40, 290)],
                         [_run(9, 600), _run(8, 610), _run(10, 590)])
    met, verdicts = vt.check_targets(settings, 16, min_speedup=3.0, max_memory_ratio=0.6)
    assert met
    assert verdicts == ["G=16: r1fit 3.33x TRL's tokens/s (target >= 3) -> met; peak 0.50x "
                        "TRL's (target <= 0.6) -> met"]
    met, verdicts = vt.check_targets(settings, 16, min_speedup=4.0, max_memory_ratio=0.6)
    assert not met and "-> MISSED; peak 0.50x" in verdicts[0]


def test_unequal_completion_lengths_fail_the_comparison():
    """At any G: a side that stops early does less work per token, so tokens/s no longer
    compare."""
    settings = {**_settings([_run(30, 300, length=64)], [_run(9, 600, length=40)], g=8),
                **_settings([_run(30, 300)], [_run(9, 600)], g=16)}
    met, verdicts = vt.check_targets(settings, 16, min_speedup=3.0, max_memory_ratio=0.6)
    assert not met
    assert verdicts[0] == ("G=8: mean completion lengths differ by 60% (> 5%): not a "
                           "like-for-like comparison")
    assert verdicts[1].endswith("-> met")


def test_the_floor_note_says_when_the_memory_target_is_below_it():
    mib = 2**20
    # floor 1,236 MiB vs TRL 2,014 MiB: 0.61x, above the 0.6x target
    note = vt.floor_note(1236 * mib, 2014 * mib, 0.6)
    assert note.startswith("r1fit's floor (weights + gradients + AdamW states, in both sides' "
                           "peaks over load): 1,236 MiB = 0.61x TRL's peak; the memory target "
                           "(0.6x) is below it")
    assert "below" not in vt.floor_note(1000 * mib, 2014 * mib, 0.6)


def test_a_disturbed_run_is_dropped_and_rerun(monkeypatch):
    args = vt.parse_args(["--max-other-cores", "0.1", "--retries", "1"])
    results = iter([_run(10, 100, other=0.8), _run(11, 100, other=0.05)])
    monkeypatch.setattr(vt, "measure", lambda *_: next(results))
    setting = vt.Setting("trl", 8)
    assert vt.measure_settled(args, setting).tokens_per_second == [11, 11]
    assert setting.disturbed == 1
    results = iter([_run(10, 100, other=0.8)] * 2)
    with pytest.raises(vt.BenchmarkError, match="2 runs in a row were disturbed"):
        vt.measure_settled(args, vt.Setting("trl", 8))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="needs TRL (pip install -e '.[bench]')")
def test_a_real_side_by_side_run(use_tiny_cache, tmp_path, capsys):
    """Both trainers run 2 GRPO steps of G=4 on builtin:tiny (about 30 s): every completion runs
    to the 8-token limit on both sides, and the table and the JSON hold both."""
    out = tmp_path / "vs_trl.json"
    status = vt.main(["--model", "builtin:tiny", "--generations", "4", "--micro-batch", "2",
                      "--max-new-tokens", "8", "--steps", "2", "--repeats", "1",
                      "--max-other-cores", "99", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status in (0, 1)  # the targets are for the real workload, not this one
    assert "r1fit vs TRL" in printed and "G=4: r1fit" in printed
    result = json.loads(out.read_text())
    # the tiny model's float32 weights, gradients and AdamW's two states (16 bytes a parameter)
    # and AdamW's float32 step count per tensor
    params = list(AutoModelForImageTextToText.from_pretrained(
        resolve_model_path("builtin:tiny")).parameters())
    assert result["floor_bytes"] == 16 * sum(p.numel() for p in params) + 4 * len(params)
    assert "r1fit's floor" in printed
    by_tool = {s["tool"]: s for s in result["settings"]}
    assert set(by_tool) == {"r1fit", "trl"}
    for s in by_tool.values():
        assert s["completion_len_mean"] == 8.0
        assert s["tokens_per_second"] > 0 and s["peak_over_load_bytes"] > 0
        assert len(s["runs"]) == 1 and len(s["runs"][0]["tokens_per_second"]) == 1
