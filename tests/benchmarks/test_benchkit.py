"""benchmarks/benchkit.py: a script's errors and exit status, its children's failures and result
lines (children are small ``python -c`` programs)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

import pytest
from benchkit import (
    FOLDER,
    TAIL_LINES,
    BenchmarkError,
    UnreadWeights,
    child_error,
    cpu_ticks,
    failure_text,
    main,
    other_cores,
    positive,
    print_result,
    read_result,
    result_prefix,
    run_child,
    unread_mapped_bytes,
)

from r1fit.errors import R1fitError


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# ----------------------------------------------------------------------------------------------
# main: exit status and one-line errors


def _parse(argv):
    p = argparse.ArgumentParser(prog="demo")
    p.add_argument("--code", type=positive, default=1)
    return p.parse_args(argv)


def test_main_returns_what_the_run_returns():
    assert main("demo", _parse, lambda args: args.code - 1, ["--code", "1"]) == 0
    assert main("demo", _parse, lambda args: args.code - 1, ["--code", "2"]) == 1


def _raise(exc: BaseException):
    def run(args):
        raise exc
    return run


def test_main_prints_a_benchmark_error_as_one_line_and_exits_2(capsys):
    assert main("demo", _parse, _raise(BenchmarkError("--model x: not a folder")), []) == 2
    assert capsys.readouterr().err == "demo: error: --model x: not a folder\n"


def test_main_folds_an_r1fit_error_onto_one_line(capsys):
    class SomeR1fitError(R1fitError):  # as ConfigError, DataError, ...
        pass

    assert main("demo", _parse, _raise(SomeR1fitError("unknown key 'algo.bta'\n  did you mean")),
                []) == 2
    assert capsys.readouterr().err == "demo: error: unknown key 'algo.bta' did you mean\n"


def test_main_keeps_the_traceback_of_anything_else():
    with pytest.raises(ZeroDivisionError):
        main("demo", _parse, lambda args: 1 // 0, [])


def test_main_bad_arguments_exit_2(refused):
    assert "integer >= 1" in refused(lambda argv: main("demo", _parse, lambda args: 0, argv),
                                     ["--code", "0"])


# ----------------------------------------------------------------------------------------------
# a child's failure


def test_child_error_takes_the_last_line_of_that_script_wherever_it_starts():
    stderr = ("INFO r1fit: data: 64 rows\n"
              "memory_vs_group: error: run at G=2: first\n"
              "r1fit: error: another program's line\n"
              "[rank1]: memory_vs_group: error: run at G=2: model folder '/x' does not exist\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert child_error(stderr, "memory_vs_group") == "run at G=2: model folder '/x' does not exist"
    assert child_error(stderr, "r1fit") == "another program's line"
    assert child_error(stderr, "load_scaling") is None


def test_run_child_returns_stdout():
    assert run_child(_python("print('a'); print('b')"), "demo", "demo") == "a\nb\n"


def test_run_child_raises_the_childs_own_line_with_what_it_did():
    command = _python("""
        import sys
        print('Traceback (most recent call last):', file=sys.stderr)
        print('[rank0]: demo: error: --model x: does not exist', file=sys.stderr)
        sys.exit(2)
        """)
    with pytest.raises(BenchmarkError) as info:
        run_child(command, "rank0 N=2", "demo")
    assert str(info.value) == "rank0 N=2: --model x: does not exist"


def test_run_child_raises_the_end_of_a_traceback():
    command = _python("""
        import sys
        print('other: error: not ours', file=sys.stderr)
        for i in range(40):
            print(f'line {i}', file=sys.stderr)
        sys.exit(3)
        """)
    with pytest.raises(BenchmarkError) as info:
        run_child(command, "saving x", "demo")
    tail = "\n".join(f"line {i}" for i in range(40 - TAIL_LINES, 40))
    assert str(info.value) == f"saving x failed (exit 3):\n{tail}"


def test_failure_text_keeps_a_ranks_cause_printed_above_torchruns_summary():
    """torchrun's summary fills the tail; the aborted rank's own lines above it are kept, in
    order, and lines that name no cause are not."""
    stderr = "\n".join(["Loading weights: 100%",
                        "terminate called after throwing an instance of 'gloo::IoException'",
                        "  what():  Connection closed by peer",
                        "some progress",
                        *(f"summary {i}" for i in range(TAIL_LINES))])
    assert failure_text(stderr) == "\n".join([
        "terminate called after throwing an instance of 'gloo::IoException'",
        "  what():  Connection closed by peer", "...",
        *(f"summary {i}" for i in range(TAIL_LINES))])
    assert failure_text("a\nb") == "a\nb"  # short: all of it, nothing marked


def test_run_child_passes_the_environment_and_stops_at_the_timeout():
    command = _python("import os; print(os.environ['BENCH_X'])")
    assert run_child(command, "demo", "demo", env={"BENCH_X": "7"}) == "7\n"
    with pytest.raises(BenchmarkError, match=r"^rank0 N=4: no result in 1 s$"):
        run_child(_python("import time; time.sleep(60)"), "rank0 N=4", "demo", timeout=1)


def test_run_child_logs_what_a_child_printed_before_its_timeout(tmp_path):
    """The log gets each line as the child prints it: a child killed at its timeout leaves its
    output (here a line on each stream before it hangs) between the header and the timeout line."""
    log = tmp_path / "log.txt"
    child = _python("import sys, time; print('step 1 done', flush=True); "
                    "print('loading', file=sys.stderr, flush=True); time.sleep(60)")
    with pytest.raises(BenchmarkError, match=r"^hung run: no result in 2 s$"):
        run_child(child, "hung run", "demo", timeout=2, log=log)
    lines = log.read_text().splitlines()
    assert lines[0] == "==== hung run ====" and lines[-1] == "==== hung run (no result in 2 s) ===="
    assert sorted(lines[1:-1]) == ["loading", "step 1 done"]
    assert run_child(_python("print('ok')"), "quick", "demo", log=log) == "ok\n"
    assert log.read_text().splitlines()[-3:] == ["==== quick ====", "ok", "==== quick (exit 0) ===="]


def test_a_child_running_main_reaches_the_parent_as_one_line(tmp_path):
    """The whole contract: an r1fit error in a child's run comes back whole, with the child's
    exit status 2 and no traceback."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import argparse
        import sys
        sys.path.insert(0, {str(FOLDER)!r})
        from benchkit import main
        from r1fit.errors import R1fitError

        def run(args):
            raise R1fitError("model folder '/x' does not exist;\\nrun r1fit ... first")

        sys.exit(main("child", lambda argv: argparse.Namespace(), run))
        """))
    with pytest.raises(BenchmarkError) as info:
        run_child([sys.executable, str(script)], "run at G=2", "child")
    assert str(info.value) == "run at G=2: model folder '/x' does not exist; run r1fit ... first"


# ----------------------------------------------------------------------------------------------
# a child's result


def test_read_result_takes_the_last_result_line_among_other_output(capsys):
    print("Loading weights: 100%")
    print_result("demo", {"n": 1})
    print_result("other", {"n": 2})
    print_result("demo", {"n": 3, "seconds": [0.5]})
    print("done")
    assert read_result(capsys.readouterr().out, "demo", "loading x") == {"n": 3, "seconds": [0.5]}


@pytest.mark.parametrize("stdout, message", [
    ("nothing here\n", "loading x: no result line in the output"),
    (result_prefix("other") + "{}\n", "loading x: no result line in the output"),
    (result_prefix("demo") + "{not json\n", "loading x: bad result line"),
])
def test_read_result_rejects_a_missing_or_broken_line(stdout, message):
    with pytest.raises(BenchmarkError, match=f"^{message}"):
        read_result(stdout, "demo", "loading x")


def test_other_cores_subtract_the_runs_own_cpu_time():
    # the machine was busy 300 ticks in 2 s, 100 of them this process's: 1 core of others
    assert other_cores((1000, 50), (1300, 150), 2.0, 100) == 1.0
    assert other_cores((1000, 50), (1100, 160), 1.0, 100) == 0.0  # tick rounding, not < 0
    assert other_cores(None, (1, 1), 1.0, 100) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_cpu_ticks_see_this_process_work():
    before = cpu_ticks()
    started = time.process_time()
    while time.process_time() - started < 0.3:
        pass
    after = cpu_ticks()
    assert after[1] - before[1] >= 0.2 * os.sysconf("SC_CLK_TCK")
    assert after[0] - before[0] >= after[1] - before[1] - 2  # the machine's busy time holds ours


SMAPS = """\
55d0c0000000-55d0c0400000 r--p 00000000 08:01 11 /models/a/model.safetensors
Size:               4096 kB
Rss:                1024 kB
Anonymous:             0 kB
7f0000000000-7f0000200000 r-xp 00000000 08:01 12 /usr/lib/libc.so.6
Size:               2048 kB
Rss:                2048 kB
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                 512 kB
7f0000600000-7f0000a00000 r--p 00000000 08:01 13 /models/my weights.safetensors
Size:               4096 kB
Rss:                4096 kB
"""


def test_unread_mapped_bytes_sums_the_checkpoint_mappings_only(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert unread_mapped_bytes(smaps=str(smaps)) == (8192 * 1024, 3072 * 1024)
    assert unread_mapped_bytes(".so.6", smaps=str(smaps)) == (2048 * 1024, 0)
    assert unread_mapped_bytes(smaps=str(tmp_path / "missing")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_unread_weights_sees_pages_of_a_mapped_file_that_were_never_read(tmp_path):
    import mmap

    path = tmp_path / "w.safetensors"
    path.write_bytes(os.urandom(8 * 2**20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        mapped.madvise(mmap.MADV_RANDOM)  # no read-ahead: only the pages touched
        with UnreadWeights(interval=0.01) as watch:
            sum(mapped[i] for i in range(0, 2 * 2**20, 4096))  # read the first 2 MiB
            time.sleep(0.1)
        assert 5 * 2**20 <= watch.bytes <= 6 * 2**20
