"""The bookkeeping of benchmarks/memory_vs_group.py on hand-made run folders (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchkit import BenchmarkError, load_script, result_prefix

MIB = 2**20

mvg = load_script("memory_vs_group")


def _fake_run(folder: Path, base: int, peaks: list[int], tokens: list[float],
              seconds: list[tuple[float, float, float]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"steps": len(peaks),
                                                     "rss_after_load_bytes": base}))
    rows = []
    for step, (peak, tps, (gen, score, upd)) in enumerate(zip(peaks, tokens, seconds), start=1):
        rows.append({"step": step, "reward_mean": 0.0, "peak_memory_bytes": peak,
                     "tokens_per_second": tps, "seconds_generate": gen, "seconds_score": score,
                     "seconds_update": upd})
    rows.append({"step": len(peaks), "eval/accuracy": 0.5})  # eval-only rows are not steps
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_summarise_run_subtracts_the_load_baseline_and_skips_step_one(tmp_path):
    out = _fake_run(tmp_path / "run", base=800 * MIB,
                    peaks=[1500 * MIB, 1600 * MIB, 1550 * MIB],
                    tokens=[1.0, 4.0, 6.0],
                    seconds=[(9.0, 0.0, 9.0), (2.0, 0.5, 3.0), (3.0, 0.5, 4.5)])
    result = mvg.summarise_run(out, 4)
    assert result.step_peaks_over_load == [700 * MIB, 800 * MIB, 750 * MIB]
    assert result.peak_over_load == 800 * MIB
    assert result.tokens_per_second == [4.0, 6.0]
    assert result.seconds_per_step == [5.5, 8.0]


def test_summarise_run_needs_the_load_baseline(tmp_path):
    out = _fake_run(tmp_path / "run", base=1, peaks=[2, 3], tokens=[1.0, 1.0],
                    seconds=[(1.0, 0.0, 1.0)] * 2)
    (out / "summary.json").write_text(json.dumps({"steps": 2}))
    with pytest.raises(BenchmarkError, match="rss_after_load_bytes"):
        mvg.summarise_run(out, 2)


def test_setting_takes_medians_over_repeats():
    def run(peak: int, tps: list[float]) -> object:
        return mvg.RunResult(2, 100, [peak - 10, peak], tps, [1.0] * len(tps))

    setting = mvg.Setting(2, 2, 2, [run(500, [1.0, 3.0]), run(300, [4.0, 4.0]),
                                    run(400, [9.0, 5.0])])
    assert setting.peak_over_load == 400  # median of 500, 300, 400
    assert setting.tokens_per_second == 4.0  # median of the per-run medians 2, 4, 7


def test_target_compares_largest_with_smallest_group():
    def setting(g: int, peak: int) -> object:
        return mvg.Setting(g, 2, 2, [mvg.RunResult(g, 0, [peak], [1.0], [1.0])])

    met, verdict = mvg.check_target([setting(2, 1000 * MIB), setting(16, 1100 * MIB)], 1.10)
    assert met and "met" in verdict
    met, verdict = mvg.check_target([setting(2, 1000 * MIB), setting(16, 1101 * MIB)], 1.10)
    assert not met and "peak(G=16) <= 1.10 x peak(G=2)" in verdict and "MISSED" in verdict


def test_child_env_adds_pairs_and_rejects_malformed_ones():
    env = mvg.child_env(["MALLOC_ARENA_MAX=2", "X=a=b"])
    assert env["MALLOC_ARENA_MAX"] == "2" and env["X"] == "a=b"
    with pytest.raises(BenchmarkError, match="NOEQUALS"):
        mvg.child_env(["NOEQUALS"])


def test_run_overrides_pin_everything_but_the_group_size(tmp_path):
    args = mvg.parse_args(["--micro-batch", "2", "--generation-batch", "1", "--steps", "2"])
    overrides = mvg.run_overrides(args, 8, tmp_path)
    assert "algo.num_generations=8" in overrides
    assert {"memory.micro_batch=2", "memory.generation_batch=1", "train.prompts_per_step=1",
            "sft.format_warmup_steps=0", "data.eval=null", "train.max_steps=2",
            "train.device=cpu", "algo.max_new_tokens=32"} <= set(overrides)
    from r1fit.config import load_config

    cfg = load_config(None, overrides)  # every override is a valid key
    assert cfg.algo.num_generations == 8 and cfg.data.eval is None


@pytest.mark.parametrize("argv, message", [
    (["--generations", "1", "4"], "every G must be >= 2"),
    (["--generations", "4", "4"], "at least two different"),
    (["--steps", "1"], "--steps"),
    (["--micro-batch", "0"], "integer >= 1"),
])
def test_bad_arguments_are_one_line_errors(argv, message, refused):
    assert message in refused(mvg.parse_args, argv)


def test_measure_runs_one_child_and_reads_its_result_line(tmp_path, monkeypatch):
    args = mvg.parse_args(["--micro-batch", "2", "--steps", "2", "--model", "builtin:tiny"])
    out = _fake_run(tmp_path / "run", base=800 * MIB, peaks=[900 * MIB, 1000 * MIB],
                    tokens=[1.0, 5.0], seconds=[(1.0, 0.0, 1.0), (2.0, 0.5, 3.0)])
    child = mvg.summarise_run(out, 4)  # what the child prints after training
    calls = []

    def run_child(command, what, name, *, env=None, timeout=None):
        calls.append((command, what, name, env))
        return (f"Training: 100%\n{result_prefix(name)}"
                + json.dumps(mvg.asdict(child)) + "\n")

    monkeypatch.setattr(mvg, "run_child", run_child)
    assert mvg.measure(args, 4, {"X": "1"}) == child
    [(command, what, name, env)] = calls
    assert command[1].endswith("memory_vs_group.py") and command[2:4] == ["--one", "4"]
    assert {"--output-dir", "--micro-batch", "2", "--model", "builtin:tiny"} <= set(command)
    assert (what, name, env) == ("run at G=4", "memory_vs_group", {"X": "1"})


def test_floor_ratio_counts_the_loaded_model_back_in(tmp_path):
    out = _fake_run(tmp_path / "run", base=800 * MIB, peaks=[1500 * MIB, 1600 * MIB],
                    tokens=[1.0, 1.0], seconds=[(1.0, 0.0, 1.0)] * 2)
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "rss_before_load_bytes": 500 * MIB}))
    result = mvg.summarise_run(out, 2)
    assert result.loaded_bytes == 300 * MIB
    result.floor_bytes = 880 * MIB
    # (peak over load 800 + loaded 300) / floor 880 = 1.25
    assert result.floor_ratio == pytest.approx(1.25)
    assert mvg.Setting(2, 1, 2, [result]).floor_ratio == pytest.approx(1.25)
