"""The bookkeeping of benchmarks/throughput.py on hand-made run folders (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchkit import BenchmarkError, load_script

MIB = 2**20

tp = load_script("throughput")


def _fake_run(folder: Path, before: int, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"rss_before_load_bytes": before}))
    lines = [{"step": i, "reward_mean": 0.0, **row} for i, row in enumerate(rows, start=1)]
    lines.append({"step": len(rows), "eval/accuracy": 0.5})  # eval rows are not steps
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def _row(update: float, tps: float, mfu: float, peak: int, length: float = 16.0) -> dict:
    return {"seconds_update": update, "seconds_generate": 2 * update, "tokens_per_second": tps,
            "mfu": mfu,
            "peak_memory_bytes": peak, "completion_len_mean": length}


def test_summarise_run_skips_step_one_and_subtracts_the_rss_before_load(tmp_path):
    out = _fake_run(tmp_path / "run", 500 * MIB, [
        _row(9.0, 1.0, 0.1, 1900 * MIB, 16.0),
        _row(2.0, 4.0, 0.2, 1800 * MIB, 12.0),
        _row(3.0, 6.0, 0.3, 1700 * MIB, 14.0)])
    result = tp.summarise_run(out, floor=1000 * MIB)
    assert result.seconds_update == [2.0, 3.0]
    assert result.seconds_generate == [4.0, 6.0]
    assert result.tokens_per_second == [4.0, 6.0]
    assert result.mfu == [0.2, 0.3]
    assert result.peak_bytes == 1400 * MIB  # the largest step, step 1 included, minus 500
    assert result.floor_bytes == 1000 * MIB
    assert result.completion_len_mean == 14.0


def test_a_live_tensor_run_keeps_its_peak_whole(tmp_path):
    # memory.cpu_peak=tensors logs every live tensor, weights included: nothing to subtract
    out = _fake_run(tmp_path / "run", 500 * MIB, [
        _row(9.0, 1.0, 0.1, 1900 * MIB), _row(2.0, 4.0, 0.2, 1800 * MIB)])
    assert tp.summarise_run(out, floor=1000 * MIB, tensors=True).peak_bytes == 1900 * MIB
    assert tp.run_overrides(tp.parse_args(["--quick"]), "lora", 4, "shared+tensors", tmp_path)[-1] \
        == "memory.cpu_peak=tensors"


def test_summarise_run_needs_two_steps_and_the_baseline(tmp_path):
    one = _fake_run(tmp_path / "one", 1, [_row(1.0, 1.0, 0.1, 2)])
    with pytest.raises(BenchmarkError, match="1 step rows"):
        tp.summarise_run(one, floor=1)
    old = _fake_run(tmp_path / "old", 1, [_row(1.0, 1.0, 0.1, 2)] * 2)
    (old / "summary.json").write_text(json.dumps({"rss_after_load_bytes": 1}))
    with pytest.raises(BenchmarkError, match="rss_before_load_bytes"):
        tp.summarise_run(old, floor=1)


def _setting(mode: str, g: int, variant: str, update: float, peak: int, floor: int):
    run = tp.RunResult([update], [2.0], [1.0], [0.01], peak, floor, 16.0)
    return tp.Setting(mode, g, variant, [run])


def test_targets_compare_shared_with_per_row_at_g8_and_every_peak_with_its_floor():
    settings = [_setting("full", 8, "per_row", 10.0, 120, 100),
                _setting("full", 8, "shared", 5.0, 110, 100),  # 0.5x: met
                _setting("lora", 8, "per_row", 10.0, 100, 100),
                _setting("lora", 8, "shared", 7.0, 126, 100),  # 0.7x and 1.26x: both missed
                _setting("full", 16, "shared", 1.0, 100, 100)]  # G=16: no update target
    met, verdicts = tp.check_targets(settings, max_update_ratio=0.6, max_floor_ratio=1.25)
    assert not met
    assert "full G=8: shared update phase 0.50x per_row (target <= 0.60) -> met" in verdicts
    assert "lora G=8: shared update phase 0.70x per_row (target <= 0.60) -> MISSED" in verdicts
    assert "lora G=8 shared: peak 1.26x the floor (target <= 1.25) -> MISSED" in verdicts
    assert sum("update phase" in v for v in verdicts) == 2
    met, _ = tp.check_targets(settings[:2], max_update_ratio=0.6, max_floor_ratio=1.25)
    assert met


def test_mapped_weights_the_rss_never_held_count_toward_the_floor_target():
    run = tp.RunResult([1.0], [2.0], [1.0], [0.01], 100 * MIB, 100 * MIB, 16.0,
                       unread_weight_bytes=30 * MIB)
    met, verdicts = tp.check_targets([tp.Setting("lora", 8, "shared", [run])],
                                     max_update_ratio=0.6, max_floor_ratio=1.25)
    assert not met  # 1.00x in RSS, 1.30x with the unread weights
    assert verdicts == ["lora G=8 shared: peak 1.30x the floor, counting 30 MiB of mapped weights "
                        "the RSS never held (target <= 1.25) -> MISSED"]


def test_with_a_baseline_tree_the_update_target_is_taken_against_its_per_row_path():
    settings = [_setting("full", 8, tp.BASELINE, 10.0, 100, 100),
                _setting("full", 8, "per_row", 9.0, 100, 100),
                _setting("full", 8, "shared", 5.5, 100, 100),
                _setting("full", 8, "packed", 6.5, 100, 100)]
    met, verdicts = tp.check_targets(settings, max_update_ratio=0.6, max_floor_ratio=1.25)
    assert not met
    assert "full G=8: shared update phase 0.55x per_row@base (target <= 0.60) -> met" in verdicts
    assert "full G=8: packed update phase 0.65x per_row@base (target <= 0.60) -> MISSED" \
        in verdicts


def test_the_baseline_variant_runs_the_per_row_path_from_the_other_tree(tmp_path, refused):
    args = tp.parse_args(["--quick"])
    assert tp.run_overrides(args, "full", 4, tp.BASELINE, tmp_path) == \
        tp.run_overrides(args, "full", 4, "per_row", tmp_path)
    assert "holds no r1fit package" in refused(tp.parse_args, ["--baseline-src", str(tmp_path)])


def test_setting_medians_over_repeats():
    runs = [tp.RunResult([1.0, 3.0], [2.0], [5.0], [0.1], 300, 10, 16.0),
            tp.RunResult([4.0, 4.0], [2.0], [7.0], [0.2], 100, 10, 16.0),
            tp.RunResult([9.0, 5.0], [2.0], [6.0], [0.3], 200, 10, 16.0)]
    setting = tp.Setting("full", 8, "shared", runs)
    assert setting.median("seconds_update") == 4.0  # median of the per-run medians 2, 4, 7
    assert setting.peak == 200


def test_run_overrides_switch_only_the_variant(tmp_path):
    args = tp.parse_args(["--quick"])
    per_row = tp.run_overrides(args, "full", 4, "per_row", tmp_path)
    shared = tp.run_overrides(args, "full", 4, "shared", tmp_path)
    assert set(per_row) ^ set(shared) == {"memory.share_prefix=false", "memory.share_prefix=true"}
    lora = tp.run_overrides(args, "lora", 4, "shared", tmp_path)
    assert set(lora) - set(shared) == {"model.lora.r=16"}
    packed = tp.run_overrides(args, "full", 4, "packed", tmp_path)
    assert set(packed) - set(shared) == {"memory.micro_batch_tokens=8192"}
    released = tp.run_overrides(args, "full", 4, "packed+release_freed", tmp_path)
    assert set(released) - set(packed) == {"memory.release_freed=true"}
    assert set(packed) - set(released) == set()
    both = tp.run_overrides(args, "full", 4, "shared+recompute+chunk256+release_freed", tmp_path)
    assert both == [*shared, "memory.fused_loss=false", "memory.logits_chunk=256",
                    "memory.release_freed=true"]
    chunked = tp.run_overrides(tp.parse_args(["--quick", "--set", "memory.logits_chunk=256"]),
                               "full", 4, "packed", tmp_path)
    assert chunked == [*packed, "memory.logits_chunk=256"]


def test_bad_arguments_are_refused(refused):
    assert "--image-size: must be a multiple of 28" in refused(tp.parse_args, ["--image-size", "100"])
    assert "--steps: need >= 2" in refused(tp.parse_args, ["--steps", "1"])
    assert "--variants: unknown suffix in 'shared+fast'" in refused(
        tp.parse_args, ["--variants", "shared", "shared+fast"])
    assert "--variants: unknown suffix in 'shared+release_freed+recompute'" in refused(
        tp.parse_args, ["--variants", "shared+release_freed+recompute"])  # out of order
    assert "--variants: unknown 'rows'" in refused(tp.parse_args, ["--variants", "rows"])
    assert "--set: expected KEY=VALUE" in refused(tp.parse_args, ["--set", "memory.budget"])
