"""Packages only some runs need are imported where they are used: `r1fit train`, `sft` and `plan` on
built-in data run without ``datasets`` (Hugging Face tables), ``rapidfuzz`` (the ``fuzzy`` answer
method), ``math_verify`` (the ``math`` method), ``trl`` and ``vllm`` (a GPU image may lack them;
benchmarks/gpu_check.py runs r1fit there without carrying them)."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("datasets", "rapidfuzz", "math_verify", "trl", "vllm")

# in a fresh process: the optional packages made unimportable, then every module a run on built-in
# data imports, the built-in data read and scored with the default answer method
SCRIPT = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
from r1fit.cli import main
from r1fit.config import load_config
from r1fit.data.build import build_datasets
from r1fit.rewards.methods import score_by_method
import r1fit.train.grpo, r1fit.train.sft, r1fit.memory.planner
train, _ = build_datasets(load_config(None, ["data.eval=null"]))
assert len(train) > 0
assert score_by_method("default", "<answer>3</answer>", "3") == 1.0
print("ok")
"""


def test_a_run_on_built_in_data_needs_no_optional_package():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_the_fuzzy_method_still_scores_with_rapidfuzz():
    from r1fit.rewards.methods import score_by_method

    assert score_by_method("fuzzy", "<answer>the red circle</answer>", "the red circles") > 0.9
