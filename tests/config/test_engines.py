"""rollout.engine: what ``auto`` picks on each machine, and what ``static`` refuses."""

from __future__ import annotations

import importlib.util

import pytest

from r1fit.config import engines
from r1fit.config.engines import resolve_engine, sft_engine
from r1fit.config.engines import vllm_installed as real_vllm_installed  # before any patching
from r1fit.config.values import ConfigError


def test_auto_is_hf_on_cpu_and_static_on_cuda_without_vllm(monkeypatch):
    assert resolve_engine("auto", device_type="cpu", distributed=False)[0] == "hf"
    monkeypatch.setattr(engines, "vllm_installed", lambda: False)
    name, why = resolve_engine("auto", device_type="cuda", distributed=False)
    assert name == "static" and "vLLM not installed" in why
    # several processes: hf, with the reason
    name, why = resolve_engine("auto", device_type="cuda", distributed=True)
    assert name == "hf" and "one process" in why
    # a flash-attention model: hf, with the reason
    name, why = resolve_engine("auto", device_type="cuda", distributed=False,
                               attention="flash_attention_2")
    assert name == "hf" and "not flash_attention_2" in why


def test_auto_is_vllm_on_cuda_where_installed(monkeypatch):
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    assert resolve_engine("auto", device_type="cuda", distributed=True)[0] == "vllm"
    # vLLM's presence is read without importing it
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm"
                        else None)
    assert real_vllm_installed()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not real_vllm_installed()


def test_a_named_engine_is_taken_as_set():
    for name in ("hf", "vllm", "static"):
        assert resolve_engine(name, device_type="cpu", distributed=False) == (name, "set")


def test_static_refuses_several_processes_and_a_bad_name_is_an_error():
    with pytest.raises(ConfigError, match="one process only"):
        resolve_engine("static", device_type="cuda", distributed=True)
    with pytest.raises(ConfigError, match="needs model.attn_implementation sdpa or eager"):
        resolve_engine("static", device_type="cuda", distributed=False,
                       attention="flash_attention_2")
    with pytest.raises(ConfigError, match="rollout.engine must be auto"):
        resolve_engine("fast", device_type="cuda", distributed=False)


def test_sft_evaluates_on_the_static_engine_where_it_runs_and_never_on_vllm(monkeypatch):
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)  # installed: still not taken
    for setting in ("auto", "vllm"):
        name, why = sft_engine(setting, device_type="cuda", distributed=False)
        assert name == "static" and "CUDA graphs" in why
        assert ("without vLLM" in why) is (setting == "vllm")
        assert sft_engine(setting, device_type="cpu", distributed=False)[0] == "hf"
        name, why = sft_engine(setting, device_type="cuda", distributed=True)
        assert name == "hf" and "one process" in why
        name, why = sft_engine(setting, device_type="cuda", distributed=False,
                               attention="flash_attention_2")
        assert name == "hf" and "not flash_attention_2" in why
    # named ones as GRPO takes them, static's refusals included
    assert sft_engine("hf", device_type="cuda", distributed=False) == ("hf", "set")
    assert sft_engine("static", device_type="cpu", distributed=False) == ("static", "set")
    with pytest.raises(ConfigError, match="one process only"):
        sft_engine("static", device_type="cuda", distributed=True)
    with pytest.raises(ConfigError, match="rollout.engine must be auto"):
        sft_engine("fast", device_type="cuda", distributed=False)


def test_vllm_serves_the_model_types_its_weight_sync_was_checked_on(monkeypatch):
    """Gemma 3's vision tower has other names in transformers v5 than in vLLM, and its weight
    sync fails: auto takes the static engine instead (saying why), and rollout.engine=vllm is
    refused with one line; a model type not known (None) is not checked."""
    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    for model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", None):
        assert resolve_engine("auto", device_type="cuda", distributed=False,
                              model_type=model_type)[0] == "vllm"
        assert resolve_engine("vllm", device_type="cuda", distributed=False,
                              model_type=model_type) == ("vllm", "set")
    name, why = resolve_engine("auto", device_type="cuda", distributed=False,
                               model_type="gemma3")
    assert (name, why) == ("static", "CUDA, vLLM's weight sync does not serve gemma3: the "
                                     "static-cache engine with CUDA graphs")
    name, why = resolve_engine("auto", device_type="cuda", distributed=True, model_type="gemma3")
    assert name == "hf" and why.startswith("vLLM's weight sync does not serve gemma3 and ")
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm does not run gemma3 models yet"):
        resolve_engine("vllm", device_type="cuda", distributed=False, model_type="gemma3")


def test_the_plan_resolves_the_engine_for_the_model_s_type(use_tiny_cache, monkeypatch):
    """r1fit plan reads the model's type from its config: the built-in Gemma 3 is planned on the
    static engine where vLLM is installed, a Qwen2-VL model on vLLM."""
    from r1fit.config import load_config
    from r1fit.memory.planner import plan_memory

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    for path, engine in (("builtin:tiny-gemma3", "static"), ("builtin:tiny-qwen2vl", "vllm")):
        cfg = load_config(None, [f"model.path={path}", "data.eval=null"])
        assert plan_memory(cfg, device_type="cuda").details["engine"] == engine, path
