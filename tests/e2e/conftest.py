"""Shared pieces of the whole-run tests: a reward plugin with varied scores, run comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from r1fit.report.metrics import read_metrics

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


#: the call a scripted first turn writes (builtin:shapes zoom rows have one image)
ZOOM_CALL = ('<tool_call>\n{"name": "zoom", "arguments": {"x": 0.5, "y": 0.5, "factor": 4}}\n'
             '</tool_call>')


@pytest.fixture
def tool_calling_policy(monkeypatch: pytest.MonkeyPatch) -> str:
    """GRPO's HF engine with the tiny model, except that in its first turn a row writes
    ``ZOOM_CALL`` when its seed is even (every row when greedy): random weights never write a
    call. The later turns are the model's own, generated from contexts that hold the tool's
    image. Returns the call's text."""
    from r1fit.train import engines

    real = engines.hf_generate_turn

    def make(model, tokenizer, settings, ids, device):
        model_turn = real(model, tokenizer, settings, ids, device)
        call = torch.tensor(tokenizer(ZOOM_CALL, add_special_tokens=False)["input_ids"])

        def turn(rows, seeds, limits):
            out = model_turn(rows, seeds, limits)
            for i, row in enumerate(rows):
                first = "<tool_response>" not in tokenizer.decode(row.input_ids.tolist())
                if first and (seeds is None or seeds[i] % 2 == 0):
                    out[i] = call[:limits[i]].clone()
            return out

        return turn

    monkeypatch.setattr(engines, "hf_generate_turn", make)
    return ZOOM_CALL


@pytest.fixture
def tool_reward(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A reward (``toolreward:calls``) that reads the trajectory: the tool calls it made."""
    plugin = tmp_path_factory.mktemp("plugins") / "toolreward.py"
    plugin.write_text("def calls(completion, solution, trajectory=None, **info):\n"
                      "    return float(trajectory.tool_calls)\n")
    monkeypatch.syspath_prepend(str(plugin.parent))
    return plugin.parent
