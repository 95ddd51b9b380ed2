"""``r1fit doctor --check`` end to end on this CPU (one run of about a minute, shared by the tests
below), and each verdict shown able to fail: a resumed run that differs, a plan far from the
measured peak, distances over their bounds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from r1fit.cli import main
from r1fit.doctor.selfcheck import (
    PLAN_HIGH,
    PLAN_LOW,
    compare_runs,
    plan_vs_measured,
    prefill_verdict,
    prefix_verdict,
    selfcheck_overrides,
)
from r1fit.models.packing import PackingCheck
from r1fit.rollout.prefill import PrefillCheck

pytestmark = pytest.mark.slow  # the self-check runs GRPO several times

ITEMS = ["shared prompt", "shared prefill", "memory plan", "kill and resume"]


@pytest.fixture(scope="module")
def checked(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """``(exit status, the --json report, the --out folder)`` of one ``r1fit doctor --check``."""
    out = tmp_path_factory.mktemp("doctor") / "check"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))  # the children inherit it
        # the suite's one torch thread (tests/conftest.py), here and in the children: the plan
        # once depended on the thread count (the patch convolution's backward workspace, measured
        # at 16 output channels and scaled up: 0.942x at one thread, 1.007x at two; measured at
        # the tower's own width since, 0.991x at both)
        capture = _Capture()
        with capture:
            code = main(["doctor", "--check", "--json", "--out", str(out)])
    return code, json.loads(capture.text), out


class _Capture:
    """stdout of the CLI (capsys is function-scoped; the check runs once per module)."""

    def __enter__(self):
        import contextlib
        import io

        self.buffer = io.StringIO()
        self.redirect = contextlib.redirect_stdout(self.buffer)
        self.redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self.redirect.__exit__(*exc)
        self.text = self.buffer.getvalue()


def test_the_check_passes_on_this_cpu(checked):
    code, report, out = checked
    check = report["check"]
    items = {item["name"]: item for item in check["items"]}
    assert list(items) == ITEMS, check
    assert code == 0 and check["ok"], [i["summary"] for i in check["items"] if not i["ok"]]
    assert check["out"] == str(out)
    prefix, prefill = items["shared prompt"]["numbers"], items["shared prefill"]["numbers"]
    assert 0 <= prefix["distance"] <= prefix["bound"] == 0.05  # bfloat16's bound
    assert 0 <= prefill["logits_distance"] <= prefill["logits_bound"] == 0.25
    assert 0 <= prefill["keys_distance"] <= prefill["keys_bound"] == 0.05
    memory = items["memory plan"]["numbers"]
    assert memory["measured_as"] == "live tensors" and memory["planned_overhead_bytes"] == 0
    assert 1 - PLAN_LOW <= memory["ratio"] <= 1 + PLAN_HIGH
    resume = items["kill and resume"]["numbers"]
    assert resume["resumed_at"] == 1 and resume["steps"] == 3 and resume["differences"] == []
    assert resume["weights_moved"] is True and all(g > 0 for g in resume["grad_norms"])
    assert (out / "killed" / "checkpoint-3").is_dir() and (out / "straight" / "final").is_dir()
    assert "resumed grpo at step 1" in (out / "killed" / "log.txt").read_text()
    # every key the check depends on is set by the check, whatever the defaults
    config = json.loads((out / "straight" / "config.json").read_text())
    assert config["sft"]["format_warmup_steps"] == 0 and config["train"]["max_steps"] == 3
    assert config["model"]["dtype"] == "bfloat16" and config["memory"]["cpu_peak"] == "tensors"


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("checkpoint-*"))
    return to


def test_a_resume_that_differs_is_reported(checked, tmp_path):
    """The comparison behind the kill-and-resume verdict sees one metric of one step and one bit
    of one weight; timings and memory are not compared."""
    _, _, out = checked
    straight, killed = out / "straight", out / "killed"
    assert compare_runs(straight, killed) == []
    metrics = _copy(killed, tmp_path / "metrics")
    rows = [json.loads(line) for line in (metrics / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["seconds_update"] += 1.0
    rows[-1]["peak_memory_bytes"] += 1
    (metrics / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare_runs(straight, metrics) == []
    rows[1]["grad_norm"] = rows[1]["grad_norm"] * (1 + 2 ** -20)
    (metrics / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [d.split(":")[0] for d in compare_runs(straight, metrics)] == [
        "metrics row 2 (step 2)"]
    (metrics / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert "metrics: 3 rows against 2" in compare_runs(straight, metrics)

    weights = _copy(killed, tmp_path / "weights")
    file = weights / "final" / "model.safetensors"
    tensors = load_file(file)
    name = sorted(tensors)[0]
    bits = tensors[name].reshape(-1).view(torch.int16)
    bits[0] ^= 1  # the lowest bit of one bfloat16 number
    save_file(tensors, file, metadata={"format": "pt"})
    (found,) = compare_runs(straight, weights)
    assert found.startswith(f"final weights: 1 of {len(tensors)} tensors differ (first {name}")


def test_a_plan_far_from_the_measured_peak_fails(checked, tmp_path):
    _, report, out = checked
    memory = next(i for i in report["check"]["items"] if i["name"] == "memory plan")["numbers"]
    spec = selfcheck_overrides(torch.device("cpu"), torch.bfloat16)
    run = _copy(out / "straight", tmp_path / "run")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def measured(peak: int):
        for r in rows:
            r["peak_memory_bytes"] = peak
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return plan_vs_measured(spec, run)

    planned = memory["planned_bytes"]
    assert measured(planned).ok and measured(planned).numbers["ratio"] == 1.0
    under = measured(int(planned / (1 - PLAN_LOW) * 1.01))  # the plan 6% under: an OOM risk
    assert not under.ok and under.numbers["ratio"] < 1 - PLAN_LOW
    assert not measured(int(planned / (1 + PLAN_HIGH) * 0.99)).ok  # the plan 50% over
    # a peak RSS is no measure of what the plan counts (live tensors)
    assert measured(planned).ok
    assert not plan_vs_measured([*spec, "memory.cpu_peak=rss"], run).ok


def test_distances_over_their_bounds_fail():
    assert prefix_verdict(PackingCheck(0.01, 0.05, 0.001), "cpu").ok
    assert not prefix_verdict(PackingCheck(0.06, 0.05, 0.001), "cpu").ok
    assert not prefix_verdict(PackingCheck(float("nan"), 0.05, 0.001), "cpu").ok
    # the H100's 3B bfloat16 numbers: within 4x the per-row path's own rounding, as auto rules
    noisy = prefix_verdict(PackingCheck(0.125, 0.05, 0.113), "cuda, bfloat16")
    assert noisy.ok and noisy.numbers["per_row_noise"] == 0.113
    assert noisy.numbers["bound"] == pytest.approx(0.452)
    assert noisy.summary.endswith(
        "per row (cuda, bfloat16): log-probs 0.125 from the per-row path's (bound 0.452: 4x the "
        "per-row path's own rounding between batch shapes, 0.113)")
    broken = prefix_verdict(PackingCheck(0.5, 0.05, 0.113), "cuda")
    assert not broken.ok and "auto would run it per row here" in broken.summary
    assert prefill_verdict(PrefillCheck(0.002, 0.004, 0.25, 0.05), "cpu").ok
    keys = prefill_verdict(PrefillCheck(0.002, 1.3, 0.25, 0.05), "cpu")
    assert not keys.ok and "positions differ" in keys.summary
    assert not prefill_verdict(PrefillCheck(0.3, None, 0.25, 0.05), "cpu").ok
    error = PrefillCheck(float("nan"), None, 0.25, 0.05, error="generate from a copied cache fails")
    assert not prefill_verdict(error, "cpu").ok


def test_out_must_be_new_or_empty(tmp_path, capsys):
    (tmp_path / "something").write_text("mine")
    assert main(["doctor", "--check", "--out", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_out_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    for out in (blocker, blocker / "check"):
        assert main(["doctor", "--check", "--out", str(out)]) == 2  # 1 is a failed check item
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"r1fit: error: --out {out}: cannot create the folder: ")
        assert not any("Traceback" in line for line in err)
