"""The bookkeeping of benchmarks/rollout_engines.py on hand-made run results, its one-line
refusals, and one small real run of both engines (vLLM's CPU build)."""

from __future__ import annotations

import json
import time

import pytest
from benchkit import BenchmarkError, load_script, result_prefix

MIB = 2**20

rb = load_script("rollout_engines")


def _run(engine: str = "hf", g: int = 2, length: int = 4, *, seconds: float = 2.0,
         lengths: list[int] | None = None, other_cpu: float | None = 0.0) -> object:
    return rb.RunResult(engine=engine, num_generations=g, length=length, seconds=seconds,
                        completion_lengths=lengths if lengths is not None else [length] * g,
                        memory_before=1000 * MIB, memory_ready=1300 * MIB,
                        peak_load=1500 * MIB, peak_generate=1400 * MIB, peak_resettable=True,
                        other_cpu=other_cpu, threads=2, prompt_tokens=45)


def _setting(engine: str, runs: list[object], g: int = 2, length: int = 4) -> object:
    return rb.Setting(engine, g, length, runs, max_other_cpu=0.1)


def _rows(out: str) -> list[list[str]]:
    """The body rows of a printed table, as lists of cell texts."""
    return [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in out.splitlines() if line.startswith("│")]


# ----------------------------------------------------------------------------------------------
# one run, medians, other load


def test_run_result_counts_the_tokens_made_and_the_memory_over_both_baselines():
    run = _run(g=3, length=4, seconds=2.0, lengths=[4, 2, 4])
    assert (run.tokens, run.tokens_per_second, run.stopped_early) == (10, 5.0, 1)
    assert run.loaded == 300 * MIB  # ready - before
    assert run.peak_over_ready == 100 * MIB  # the timed call's peak - ready
    assert run.peak_over_before == 500 * MIB  # the loading peak was the higher one


def test_setting_takes_medians_and_counts_disturbed_runs():
    s = _setting("vllm", [_run(seconds=4.0), _run(seconds=1.0, other_cpu=0.5),
                          _run(seconds=2.0, other_cpu=None)])
    assert s.median("tokens_per_second") == 4.0  # of 2, 8, 4
    assert s.disturbed == 1  # None (no /proc) is not counted


# ----------------------------------------------------------------------------------------------
# targets


def test_target_is_met_when_every_completion_has_its_length():
    settings = [_setting("hf", [_run("hf", seconds=2.0)]),
                _setting("vllm", [_run("vllm", seconds=1.0)])]
    met, [verdict] = rb.check_targets(settings, None)
    assert met and verdict.endswith("exactly the requested length: met")
    met, verdicts = rb.check_targets(settings, 2.5)
    assert not met and verdicts[1] == ("target vllm/hf tokens/s >= 2.50 at every (G, length): "
                                       "G=2 L=4 2.00 -> MISSED at 1")
    assert rb.check_targets(settings, 2.0)[0]


def test_the_static_engine_has_its_own_target():
    settings = [_setting("hf", [_run("hf", seconds=2.0)]),
                _setting("static", [_run("static", seconds=2.5)])]
    met, verdicts = rb.check_targets(settings, None, 1.0)
    assert not met and verdicts[1] == ("target static/hf tokens/s >= 1.00 at every (G, length): "
                                       "G=2 L=4 0.80 -> MISSED at 1")
    assert rb.check_targets(settings, None, 0.8)[0]
    assert rb.check_targets(settings, 5.0, None)[0]  # no vllm row: its target is not judged


def test_an_early_stop_misses_the_target_and_says_where():
    settings = [_setting("hf", [_run("hf")]), _setting("vllm", [_run("vllm", lengths=[4, 1])])]
    met, [verdict] = rb.check_targets(settings, None)
    assert not met and "MISSED (stopped early: vllm G=2 L=4: 1 row(s)" in verdict


# ----------------------------------------------------------------------------------------------
# the parent, on fake children


def test_engines_alternate_within_each_repeat_and_disturbed_runs_are_repeated(monkeypatch, capsys):
    measured, disturbed_once = [], {("vllm", 4, 8)}

    def measure(args, folder, engine, g, length):
        measured.append((engine, g, length))
        if (engine, g, length) in disturbed_once:  # the first try only
            disturbed_once.clear()
            return _run(engine, g, length, other_cpu=0.9)
        return _run(engine, g, length, seconds=1.0 if engine == "vllm" else 2.0)

    def run_child(command, what, name, *, env=None, timeout=None):
        assert "--prepare" in command
        return result_prefix(name) + json.dumps({"folder": "/models/x"}) + "\n"

    monkeypatch.setattr(rb, "measure", measure)
    monkeypatch.setattr(rb, "run_child", run_child)
    monkeypatch.setattr(rb, "vllm_missing", lambda: None)
    assert rb.main(["--generations", "2", "4", "--lengths", "8", "--repeats", "2",
                    "--retries", "1", "--engines", "hf", "vllm"]) == 0
    first = [("hf", 2, 8), ("vllm", 2, 8), ("hf", 4, 8), ("vllm", 4, 8), ("vllm", 4, 8)]
    assert measured == first + [("hf", 2, 8), ("vllm", 2, 8), ("hf", 4, 8), ("vllm", 4, 8)]
    captured = capsys.readouterr()
    assert "vllm G=4 L=8: other processes used 0.90 cores (> 0.1); dropped, repeating" \
        in captured.err
    rows = _rows(captured.out)
    assert [row[:4] for row in rows] == [["2", "8", "hf", "2"], ["2", "8", "vllm", "2"],
                                         ["4", "8", "hf", "2"], ["4", "8", "vllm", "2"]]
    assert rows[0][4] == "8.0" and rows[1][4:6] == ["16.0", "2.00"]  # tokens/s, x hf
    assert rows[3][-2:] == ["1", "0"]  # one dropped, none kept disturbed


def test_a_missing_vllm_is_one_line_naming_the_install(monkeypatch, capsys):
    monkeypatch.setattr(rb, "VLLM_MODULE", "no_such_module_for_r1fit")
    assert rb.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert err == ("rollout_engines: error: vLLM is not installed: pip install -e '.[vllm]' "
                   "(GPU) or bash .ci/install_vllm_cpu.sh (CPU) (or leave it out: --engines hf "
                   "static)\n")


def test_a_failed_child_names_the_run(monkeypatch):
    def run_child(command, what, name, *, env=None, timeout=None):
        raise BenchmarkError(f"{what}: CUDA is not available here")

    monkeypatch.setattr(rb, "run_child", run_child)
    args = rb.parse_args(["--quick", "--device", "cuda"])
    with pytest.raises(BenchmarkError, match="^vllm at G=2, 8 tokens: CUDA"):
        rb.measure(args, "/models/x", "vllm", 2, 8)


# ----------------------------------------------------------------------------------------------
# arguments


def test_defaults_are_the_full_run_and_quick_is_tiny():
    full = rb.parse_args([])
    assert (full.generations, full.lengths, full.repeats, full.retries) == ([8, 16], [64, 256],
                                                                            3, 2)
    assert full.model == "builtin:small-realvocab" and full.min_speedup is None
    quick = rb.parse_args(["--quick", "--lengths", "16"])
    assert (quick.generations, quick.lengths, quick.repeats, quick.retries) == ([2], [16], 1, 0)


def test_child_command_passes_the_shared_settings():
    args = rb.parse_args(["--device", "cuda:1", "--threads", "3", "--allow-eos"])
    command = rb.child_command(args, "/models/x", "--one", "vllm")
    assert command[1].endswith("rollout_engines.py") and command[2:4] == ["--one", "vllm"]
    assert {"--allow-eos", "cuda:1", "/models/x"} <= set(command)
    assert command[command.index("--threads") + 1] == "3"


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--generations", "0"], "integer >= 1"),
    (["--lengths", "x"], "invalid positive value"),
    (["--retries", "-1"], "--retries: must be >= 0"),
    (["--min-speedup", "0"], "--min-speedup: must be > 0"),
    (["--max-other-cpu", "-0.5"], "--max-other-cpu: must be >= 0"),
    (["--one", "hf", "--generations", "2", "4"], "give one G and one length"),
])
def test_bad_arguments_are_one_line_errors(argv, message, refused):
    assert message in refused(rb.parse_args, argv)


# ----------------------------------------------------------------------------------------------
# the real thing, small


@pytest.mark.vllm
def test_real_quick_run_of_both_engines(hd32_dir, vllm_installed, capsys):
    """``--quick`` on builtin:tiny-hd32 (G=2, 8 tokens, one child per engine; ~60 s on 2 cores
    shared with other work): the table has the three engines (hf, static, vllm) at positive
    tokens/s and full-length completions."""
    started = time.perf_counter()
    code = rb.main(["--quick", "--model", str(hd32_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _rows(out)
    assert [row[:4] for row in rows] == [["2", "8", "hf", "1"], ["2", "8", "static", "1"],
                                         ["2", "8", "vllm", "1"]]
    assert all(float(row[4].replace(",", "")) > 0 for row in rows)
    assert [row[7] for row in rows] == ["16/16", "16/16", "16/16"]
    assert "exactly the requested length: met" in out
    assert time.perf_counter() - started < 180
