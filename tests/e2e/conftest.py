"""Shared pieces of the whole-run tests: a reward plugin with varied scores, run comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r1fit.report.metrics import read_metrics


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of this folder (whole runs through the CLI) is in the slow tier."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)


# timings and memory differ between runs; everything else must match exactly
VOLATILE = ("seconds", "tokens_per_second", "peak_memory_bytes", "mfu")


@pytest.fixture
def reward_plugin(tmp_path_factory: pytest.TempPathFactory,
                  monkeypatch: pytest.MonkeyPatch) -> Path:
    """A reward (``lenreward:length``) that differs between completions, so advantages and
    gradients are not zero; returns the folder to put on the path of a child process."""
    plugin = tmp_path_factory.mktemp("plugins") / "lenreward.py"
    plugin.write_text("def length(completion, solution, **info):\n"
                      "    return len(completion) / 10\n")
    monkeypatch.syspath_prepend(str(plugin.parent))
    return plugin.parent


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(w in k for w in VOLATILE)} for r in rows]


def assert_same_run(straight: Path, resumed: Path) -> None:
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert stable(a) == stable(b)
    wa = load_file(straight / "final" / _weights(straight / "final"))
    wb = load_file(resumed / "final" / _weights(resumed / "final"))
    assert wa.keys() == wb.keys()
    for key in wa:  # bit-identical parameters
        assert torch.equal(wa[key].view(torch.uint8), wb[key].view(torch.uint8)), key


def _weights(folder: Path) -> str:
    return "adapter_model.safetensors" if (folder / "adapter_config.json").exists() \
        else "model.safetensors"


@pytest.fixture
def same_run():
    """``same_run(a, b)`` asserts two output folders hold the same run, bit for bit."""
    return assert_same_run



# Plugins of the runs with tools, written into one folder: a policy that calls the tool (random
# weights never do), a reward that reads the trajectory, and a zoom that says when it runs and can
# be slow (so a kill lands while a call is in flight). ``sitecustomize`` installs the policy in
# the child processes of tests/e2e/test_kill.py, whose PYTHONPATH holds the folder.
TOOL_PLUGINS = {
    "toolpolicy.py": '''
"""GRPO's engines (HF, static and vLLM) with the tiny model, except that in its first turn a row writes
CALL when its seed is even (every row when greedy). The later turns are the model's own, generated from
contexts that hold the tool's image."""
import torch

from r1fit.rollout.vllm_engine import VllmEngine
from r1fit.train import engines

CALL = ('<tool_call>\\n{"name": "zoom", "arguments": {"x": 0.5, "y": 0.5, "factor": 4}}\\n'
        '</tool_call>')


def scripted(model_turn, tokenizer):
    """``model_turn`` with the first turn of even-seeded (or greedy) rows replaced by CALL."""
    call = torch.tensor(tokenizer(CALL, add_special_tokens=False)["input_ids"])

    def turn(rows, seeds, limits, previous=None):
        out = model_turn(rows, seeds, limits, previous)
        for i, row in enumerate(rows):
            first = "<tool_response>" not in tokenizer.decode(row.input_ids.tolist())
            if first and (seeds is None or seeds[i] % 2 == 0):
                # a scripted turn has no engine log-probs (vLLM's give them): its trajectory's
                # engine_logp is None, and so is its step's (TIS does not run here)
                out[i] = call[:limits[i]].clone()
        return out

    return turn


def install(setattr=setattr):
    """Script the engines' turns: the HF and static turn functions and the vLLM engine's."""
    real_hf, real_vllm = engines.hf_generate_turn, VllmEngine.generate_turn
    real_static = engines.static_generate_turn

    def make(model, tokenizer, settings, ids, device):
        return scripted(real_hf(model, tokenizer, settings, ids, device), tokenizer)

    def make_static(decoder, tokenizer, settings, keep_cache=True, room=None):
        return scripted(real_static(decoder, tokenizer, settings, keep_cache, room), tokenizer)

    def vllm_turn(self, rows, seeds, limits, previous=None, **keywords):
        def model_turn(rows_, seeds_, limits_, previous_=None):
            return real_vllm(self, rows_, seeds_, limits_, previous_, **keywords)

        return scripted(model_turn, self.llm.get_tokenizer())(rows, seeds, limits, previous)

    setattr(engines, "hf_generate_turn", make)
    setattr(engines, "static_generate_turn", make_static)
    setattr(VllmEngine, "generate_turn", vllm_turn)
''',
    "sitecustomize.py": "import toolpolicy\n\ntoolpolicy.install()\n",
    "toolreward.py": '''
def calls(completion, solution, trajectory=None, **info):
    return float(trajectory.tool_calls)
''',
    "slowtool.py": '''
import os
import time
from pathlib import Path

from r1fit.tools.builtin import zoom as builtin_zoom


def zoom(context, **arguments):
    marker = os.environ.get("R1FIT_TEST_TOOL_MARKER")
    if marker:
        Path(marker).touch()
        time.sleep(0.5)
    return builtin_zoom(context, **arguments)
''',
}


@pytest.fixture
def tool_plugins(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder of ``TOOL_PLUGINS``, on the path (of a child process too, via PYTHONPATH)."""
    folder = tmp_path_factory.mktemp("tool_plugins")
    for name, text in TOOL_PLUGINS.items():
        (folder / name).write_text(text.lstrip())
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.fixture
def tool_calling_policy(tool_plugins: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``toolpolicy`` installed in this process (until the test ends); returns the call."""
    import toolpolicy

    toolpolicy.install(monkeypatch.setattr)
    return toolpolicy.CALL
