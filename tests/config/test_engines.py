"""rollout.engine: what ``auto`` picks on each machine, and what ``static`` refuses."""

from __future__ import annotations

import importlib.util

import pytest

from r1fit.config.engines import resolve_engine
from r1fit.config.values import ConfigError


def test_auto_is_hf_on_cpu_and_static_on_cuda_without_vllm(monkeypatch):
    assert resolve_engine("auto", device_type="cpu", distributed=False, tools=False)[0] == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    name, why = resolve_engine("auto", device_type="cuda", distributed=False, tools=False)
    assert name == "static" and "vLLM not installed" in why
    # what the static engine does not run yet falls back to hf, with the reason
    name, why = resolve_engine("auto", device_type="cuda", distributed=False, tools=True)
    assert name == "hf" and "tool rollouts" in why
    name, why = resolve_engine("auto", device_type="cuda", distributed=True, tools=False)
    assert name == "hf" and "one process" in why


def test_auto_is_vllm_on_cuda_where_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert resolve_engine("auto", device_type="cuda", distributed=True, tools=True)[0] == "vllm"


def test_a_named_engine_is_taken_as_set():
    for name in ("hf", "vllm", "static"):
        assert resolve_engine(name, device_type="cpu", distributed=False, tools=False) == \
            (name, "set")


@pytest.mark.parametrize(("distributed", "tools", "words"), [
    (False, True, "does not run tool rollouts"), (True, False, "one process only")])
def test_static_refuses_what_it_does_not_run(distributed, tools, words):
    with pytest.raises(ConfigError, match=words):
        resolve_engine("static", device_type="cuda", distributed=distributed, tools=tools)
