"""Every example config loads, and opens with the command that runs it (STYLE.md)."""

from pathlib import Path

import pytest

from r1fit.config import load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_example_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid_and_says_how_to_run_it(path):
    cfg = load_config(path)
    assert cfg.model.path
    first = path.read_text().splitlines()[0]
    assert first.startswith("# r1fit ") and path.name in first


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_config_for_a_real_model_has_learning_rates_it_survives(path):
    # 1e-2 (the demo's SFT rate) or 3e-3 would wreck a pre-trained 3B model in a few steps
    cfg = load_config(path)
    if cfg.model.path.startswith("builtin:"):
        assert cfg.applied_preset() == "demo"  # random weights: the demo's rates are right there
        return
    assert cfg.applied_preset() is None
    assert cfg.train.learning_rate <= 1e-4 and cfg.sft.learning_rate <= 1e-4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_plans_offline(path, use_tiny_cache, monkeypatch):
    # a hub model's config.json ships with r1fit: `r1fit plan CONFIG` needs no network, and
    # model.dtype=auto plans a Qwen checkpoint in its own bfloat16
    import huggingface_hub.constants as hub

    from r1fit.memory.planner import plan_memory

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    cfg = load_config(path)
    plan = plan_memory(cfg)
    assert plan.details["dtype"] == ("bfloat16" if cfg.model.path.startswith("Qwen/") else "float32")
