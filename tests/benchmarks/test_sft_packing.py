"""benchmarks/sft_packing.py: its data, its bookkeeping on hand-made run folders, its targets,
and one real child run of each variant on builtin:tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchkit import BenchmarkError, load_script

MIB = 2**20

sp = load_script("sft_packing")


def _fake_run(folder: Path, before: int, rows: list[tuple[float, float, float, int]]) -> Path:
    """A run folder: summary.json and metrics.jsonl with (loss, tokens/s, mfu, peak) per step."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"rss_before_load_bytes": before}))
    lines = [{"step": i, "loss": loss, "tokens_per_second": tps, "mfu": mfu,
              "peak_memory_bytes": peak} for i, (loss, tps, mfu, peak) in enumerate(rows, 1)]
    lines.append({"step": 0, "eval/accuracy": 0.5})  # not a step row
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def test_summarise_run_skips_step_one_for_speeds_not_for_losses_or_peak(tmp_path):
    out = _fake_run(tmp_path / "run", 100 * MIB, [(3.0, 10.0, 0.1, 900 * MIB),
                                                  (2.0, 20.0, 0.2, 700 * MIB),
                                                  (1.0, 30.0, 0.3, 800 * MIB)])
    result = sp.summarise_run(out)
    assert result.tokens_per_second == [20.0, 30.0] and result.mfu == [0.2, 0.3]
    assert result.losses == [3.0, 2.0, 1.0]
    assert result.peak_bytes == 800 * MIB  # step 1's 900 MiB peak, minus 100 MiB before load
    with pytest.raises(BenchmarkError, match="1 step rows"):
        sp.summarise_run(_fake_run(tmp_path / "short", 0, [(1.0, 1.0, 0.1, MIB)]))


def _setting(variant: str, tps: float, peak: int, losses: list[float]) -> object:
    s = sp.Setting(variant)
    s.runs.append(sp.RunResult([tps], [0.1], losses, peak))
    return s


def test_targets_speedup_peak_and_equal_losses():
    rows = _setting("rows", 10.0, 1000 * MIB, [2.0, 1.0])
    met, verdicts = sp.check_targets(rows, _setting("packed", 13.0, 900 * MIB, [2.0, 1.00001]),
                                     1.2)
    assert met and all(v.endswith("met") for v in verdicts)
    met, verdicts = sp.check_targets(rows, _setting("packed", 11.0, 900 * MIB, [2.0, 1.0]), 1.2)
    assert not met and "1.10x the rows' tokens/s" in verdicts[0] and "MISSED" in verdicts[0]
    met, verdicts = sp.check_targets(rows, _setting("packed", 13.0, 1100 * MIB, [2.0, 1.0]), 1.2)
    assert not met and "MISSED" in verdicts[1]
    met, verdicts = sp.check_targets(rows, _setting("packed", 13.0, 900 * MIB, [2.0, 1.01]), 1.2)
    assert not met and "MISSED" in verdicts[2]  # other losses: not the same work


def test_answers_are_log_uniform_between_the_bounds_and_seeded():
    words = sp.answer_words(2000, 5, 300, seed=0)
    assert words == sp.answer_words(2000, 5, 300, seed=0) != sp.answer_words(2000, 5, 300, seed=1)
    assert min(words) >= 5 and max(words) <= 300
    # log-uniform: the median near the geometric mean of the bounds (sqrt(5 * 300) = 38.7)
    assert 30 <= sorted(words)[1000] <= 48


def test_bad_arguments_are_refused(refused):
    assert "--steps: need >= 2" in refused(sp.parse_args, ["--steps", "1"])
    assert "--min-words (9) is above --max-words (8)" in refused(
        sp.parse_args, ["--min-words", "9", "--max-words", "8"])
    assert "--batch (65) is larger than --rows (64)" in refused(sp.parse_args, ["--batch", "65"])
    assert "multiple of 28" in refused(sp.parse_args, ["--image-size", "100"])


def test_each_variant_trains_the_built_data_with_the_same_losses(use_tiny_cache, tmp_path,
                                                               capsys):
    """The children's real work on builtin:tiny: the data loads, both variants train the same
    steps (equal losses), and each prints its result line."""
    args = sp.parse_args(["--model", "builtin:tiny", "--rows", "8", "--batch", "4", "--steps",
                          "2", "--image-size", "56", "--max-words", "40"])
    data = sp.write_data(tmp_path, args)
    rows = json.loads(data.read_text())
    assert len(rows) == 8 and all(r["conversations"][1]["value"] for r in rows)
    results = {}
    for variant in sp.VARIANTS:
        args.one, args.data, args.output_dir = variant, str(data), str(tmp_path / variant)
        assert sp.run_one(args) == 0
        line = [x for x in capsys.readouterr().out.splitlines() if "sft_packing: result: " in x]
        results[variant] = sp.RunResult(**json.loads(line[-1].split("result: ", 1)[1]))
    assert results["packed"].losses == pytest.approx(results["rows"].losses, rel=1e-5)
    assert all(r.peak_bytes > 0 and len(r.tokens_per_second) == 1 for r in results.values())
