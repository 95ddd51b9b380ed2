"""benchmarks/adapter_compute.py on builtin:tiny in bfloat16: it times a micro-batch with the
adapters in float32 and under autocast, finds their log-probs and gradients close, and its
verdict follows the target."""

from __future__ import annotations

import json

import adapter_compute
from benchkit import result_prefix


def result(capsys, *argv: str) -> tuple[int, dict]:
    status = adapter_compute.run(adapter_compute.parse_args(list(argv)))
    line = next(s for s in capsys.readouterr().out.splitlines()
                if s.startswith(result_prefix(adapter_compute.NAME)))
    return status, json.loads(line.removeprefix(result_prefix(adapter_compute.NAME)))


def test_a_small_case_times_both_and_judges_the_target(use_tiny_cache, capsys):
    small = ("builtin:tiny", "--rows", "2", "--prompt-tokens", "8", "--completion-tokens", "8",
             "--lora-r", "4", "--lora-alpha", "8", "--repeats", "2")
    status, got = result(capsys, *small, "--min-speedup", "0")
    assert status == 0 and got["met"] and got["tokens"] == 32
    assert all(len(got["seconds"][k]) == 2 and min(got["seconds"][k]) > 0
               for k in ("float32", "model"))
    # the same model and rows: bfloat16 rounding apart, and the adapters' B is not 0
    assert 0 < got["difference"] < 0.05 and got["cosine"] > 0.99
    status, got = result(capsys, *small, "--repeats", "1", "--min-speedup", "1000")
    assert status == 1 and not got["met"]
