"""The bookkeeping of benchmarks/load_scaling.py on hand-made rank figures, and one small real run."""

from __future__ import annotations

import json
import time

import pytest
from benchkit import BenchmarkError, load_script, result_prefix

MB = 10**6

ls = load_script("load_scaling")


def _rank(rank: int, growth_mb: float, seconds: float = 1.0, how: str = "ru_maxrss") -> dict:
    return {"rank": rank, "growth": int(growth_mb * MB), "how": how, "seconds": seconds,
            "rss_after": int(growth_mb * MB) // 2, "rss_anon_after": 10 * MB,
            "rss_file_after": int(growth_mb * MB) // 2 - 10 * MB}


def _setting(mode: str, runs: list[list[float]]) -> object:
    """A setting whose repeats had these per-rank growths (MB)."""
    return ls.Setting(mode, len(runs[0]), [[_rank(i, g) for i, g in enumerate(run)]
                                           for run in runs])


def _result_line(mode: str, growths: list[float]) -> str:
    return result_prefix(ls.NAME) + json.dumps({"mode": mode, "processes": len(growths),
                                          "ranks": [_rank(i, g) for i, g in enumerate(growths)]})


# ----------------------------------------------------------------------------------------------
# a rank's peak


def test_peak_growth_takes_ru_maxrss_when_the_load_raised_it():
    # imports peaked at 900, baseline 800, the load reached 1300: its own peak is 1300
    assert ls.peak_growth(800, 900, 1300, 1300) == (500, "ru_maxrss")


def test_peak_growth_ignores_a_high_water_mark_set_before_the_load():
    # imports (or torchrun, through exec) peaked at 2000 > anything the load reached (1100):
    # ru_maxrss stays 2000 and would claim a growth of 1200; the reset VmHWM knows it was 300
    assert ls.peak_growth(800, 2000, 2000, 1100) == (300, "VmHWM")
    # without a resettable high-water mark, only an upper bound is known, and said so
    assert ls.peak_growth(800, 2000, 2000, None) == (1200, "upper bound")


# ----------------------------------------------------------------------------------------------
# rank 0's result line


def test_parse_child_output_reads_the_last_result_line_among_other_output():
    stdout = "\n".join(["Loading weights: 100%", _result_line("rank0", [1.0, 2.0]),
                        "noise", _result_line("rank0", [400.0, 250.0]), ""])
    ranks = ls.parse_child_output(stdout, "rank0", 2)
    assert [r["growth"] for r in ranks] == [400 * MB, 250 * MB]


@pytest.mark.parametrize("stdout, message", [
    ("nothing here\n", "no result line"),
    (result_prefix(ls.NAME) + "{not json\n", "bad result line"),
    (_result_line("every-rank", [1.0, 1.0]), "the result is for every-rank N=2"),
    (_result_line("rank0", [1.0, 1.0, 1.0]), "the result is for rank0 N=3"),
])
def test_parse_child_output_rejects_missing_or_foreign_results(stdout, message):
    with pytest.raises(BenchmarkError, match=message):
        ls.parse_child_output(stdout, "rank0", 2)


# ----------------------------------------------------------------------------------------------
# medians, target, table


def test_setting_takes_medians_of_summed_growths_and_per_rank():
    s = _setting("rank0", [[400, 100], [420, 300], [410, 200]])
    assert s.summed_growth == 610 * MB  # median of the sums 500, 720, 610
    assert s.rank_growths == [410 * MB, 200 * MB]  # each rank's own median
    assert s.after == (305 * MB, 20 * MB, 285 * MB)  # medians of 250/360/305, 20, 230/340/285
    assert s.how == "ru_maxrss"


def test_target_compares_rank0_at_the_largest_n_with_n1():
    one = _setting("rank0", [[300]])
    every = _setting("every-rank", [[300] * 4])  # 4.0 x, but not under the target
    met, verdict = ls.check_target([one, _setting("rank0", [[450, 150]]),
                                    _setting("rank0", [[300, 120, 120, 120]]), every], 2.2)
    assert met and "N=4 660 MB = 2.20 x N=1 (300 MB)" in verdict and verdict.endswith("met")
    met, verdict = ls.check_target([one, _setting("rank0", [[300, 121, 120, 120]]), every], 2.2)
    assert not met and "2.20 x" in verdict and verdict.endswith("MISSED")


def test_table_shows_ratios_to_n1_and_to_the_weights(capsys):
    settings = [_setting("rank0", [[330]]), _setting("rank0", [[420, 250, 250, 250]]),
                _setting("every-rank", [[330, 330, 330, 330]])]
    ls.print_table(settings, 300 * MB, "title")
    rows = _rows(capsys.readouterr().out)
    assert [row[:2] for row in rows] == [["rank0", "1"], ["rank0", "4"], ["every-rank", "4"]]
    # loading, N, runs, sum peak MB, x N=1, x weights, per rank MB, sum after MB, anon, file
    assert rows[1][:10] == ["rank0", "4", "1", "1170", "3.55", "3.90", "420 250 250 250", "585",
                            "40", "545"]
    assert rows[2][3:6] == ["1320", "4.00", "4.40"]


def _rows(out: str) -> list[list[str]]:
    """The body rows of a printed table, as lists of cell texts."""
    return [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in out.splitlines() if line.startswith("│")]


def test_plan_runs_every_rank_only_above_one_process():
    assert ls.plan([1, 2, 4], 3, 1) == [("rank0", 1, 3), ("rank0", 2, 3), ("rank0", 4, 3),
                                        ("every-rank", 2, 1), ("every-rank", 4, 1)]
    assert ls.plan([1, 2], 2, 0) == [("rank0", 1, 2), ("rank0", 2, 2)]


def _fake_launches(monkeypatch, growths: dict[tuple[str, int], list[float]], tmp_path):
    launched = []

    def launch(mode, processes, folder, dtype, timeout):
        launched.append((mode, processes))
        return [_rank(i, g) for i, g in enumerate(growths[mode, processes])]

    monkeypatch.setattr(ls, "prepare", lambda model: {"folder": str(tmp_path),
                                                      "weight_bytes": 300 * MB})
    monkeypatch.setattr(ls, "launch", launch)
    return launched


def test_exit_code_follows_the_target(monkeypatch, tmp_path, capsys):
    growths = {("rank0", 1): [300], ("rank0", 2): [450, 250], ("every-rank", 2): [300, 300]}
    launched = _fake_launches(monkeypatch, growths, tmp_path)
    out_json = tmp_path / "raw.json"
    assert ls.main(["--processes", "1,2", "--repeats", "2", "--json", str(out_json)]) == 1
    assert launched == [("rank0", 1), ("rank0", 2), ("every-rank", 2), ("rank0", 1),
                        ("rank0", 2)]
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("load_scaling.py --processes 1,2 --repeats 2 --json "
                                        f"{out_json}")
    assert "N=2 700 MB = 2.33 x N=1 (300 MB); target <= 2.20 x -> MISSED" in out
    raw = json.loads(out_json.read_text())
    assert raw["target_met"] is False and raw["settings"][1]["summed_growth"] == 700 * MB
    assert ls.main(["--processes", "1,2", "--repeats", "1", "--max-ratio", "2.4"]) == 0
    assert "target <= 2.40 x -> met" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--processes", "2,4"], "must include 1"),
    (["--processes", "1"], "must include 1"),
    (["--processes", "1,x"], "comma-separated integers"),
    (["--processes", "0,1,2"], "integers >= 1"),
    (["--repeats", "0"], "integer >= 1"),
    (["--every-rank-repeats", "-1"], ">= 0"),
])
def test_bad_arguments_are_one_line_errors(argv, message, refused):
    assert message in refused(ls.parse_args, argv)


def test_processes_are_sorted_and_deduplicated():
    assert ls.parse_args(["--processes", "4,1,2,2"]).processes == [1, 2, 4]


# ----------------------------------------------------------------------------------------------
# the real thing, small


SIGNAL_SUMMARY = ("rank0 N=2 failed (exit 1):\n  exitcode  : -6 (pid: 7)\n"
                  "  traceback : Signal 6 (SIGABRT) received by PID 7")


def test_killed_by_signal_reads_torchruns_summary():
    assert ls.killed_by_signal(SIGNAL_SUMMARY)
    assert not ls.killed_by_signal("rank0 N=2 failed (exit 1):\nValueError: bad shard")
    assert not ls.killed_by_signal("rank0 N=2: no result in 600 s")


@pytest.mark.parametrize("failures", [1, 2])
def test_a_launch_killed_by_a_signal_is_launched_once_more(monkeypatch, capsys, failures):
    """Once more, with the first launch's output on stderr; a second kill is the error."""
    calls = []
    line = _result_line("rank0", [5.0])

    def run_child(command, what, name, **kwargs):
        calls.append(what)
        if len(calls) <= failures:
            raise BenchmarkError(SIGNAL_SUMMARY)
        return line + "\n"

    monkeypatch.setattr(ls, "run_child", run_child)
    if failures == 2:
        with pytest.raises(BenchmarkError, match="SIGABRT"):
            ls.launch("rank0", 1, "folder", "float32", 60)
    else:
        assert ls.launch("rank0", 1, "folder", "float32", 60)[0]["growth"] == 5.0 * MB
    assert len(calls) == 2  # never a third launch
    assert "killed by a signal; launching once more" in capsys.readouterr().err


def test_a_launch_failing_with_its_own_error_is_not_repeated(monkeypatch):
    calls = []

    def run_child(command, what, name, **kwargs):
        calls.append(what)
        raise BenchmarkError("rank0 N=2: --model x: does not exist")

    monkeypatch.setattr(ls, "run_child", run_child)
    with pytest.raises(BenchmarkError, match="does not exist"):
        ls.launch("rank0", 2, "folder", "float32", 60)
    assert len(calls) == 1


@pytest.mark.slow
def test_real_run_on_the_tiny_model(tiny_dir, capsys):
    """torchrun with 1 and 2 processes on the tiny model's folder (36 s on 2 cores shared with
    other work): every rank reports a peak, and the 2-process row is rank-0 loading's."""
    started = time.perf_counter()
    code = ls.main(["--model", str(tiny_dir), "--processes", "1,2", "--repeats", "1",
                    "--every-rank-repeats", "0", "--max-ratio", "100"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    rows = _rows(out)
    assert [row[:2] for row in rows] == [["rank0", "1"], ["rank0", "2"]]
    per_rank = rows[1][6].split()
    assert len(per_rank) == 2 and all(float(g) > 0 for g in per_rank)
    assert "target <= 100.00 x -> met" in out
    assert time.perf_counter() - started < 120
