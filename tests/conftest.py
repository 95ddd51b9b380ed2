"""Fixtures for the whole suite: `builtin:tiny` built once per session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from r1fit.models.builtin import ensure_builtin


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root (for R1FIT_CACHE) holding a freshly built builtin:tiny."""
    root = tmp_path_factory.mktemp("r1fit_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(root))
        ensure_builtin("tiny")
    return root


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    """The built tiny model folder."""
    folder = next((tiny_cache / "models").glob("tiny-v*"))
    assert (folder / "config.json").is_file()
    return folder


@pytest.fixture
def use_tiny_cache(tiny_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point R1FIT_CACHE at the session cache for one test, so `builtin:tiny` needs no rebuild."""
    monkeypatch.setenv("R1FIT_CACHE", str(tiny_cache))
    return tiny_cache


@pytest.fixture(scope="session")
def realvocab_cache(tiny_cache: Path) -> Path:
    """The session cache with builtin:small-realvocab (Qwen's 151,936-token vocabulary) built."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        ensure_builtin("small-realvocab")
    return tiny_cache


@pytest.fixture
def float64_tiny(tiny_dir: Path):
    """``make(lora_r=0) -> (model, processor, rows, completions)``: builtin:tiny in float64 with
    gradient checkpointing, and 3 builtin:shapes prompts x 2 rows with random completions of
    different lengths (so padding and masks matter), for exactness tests of log-probs and
    gradients."""
    import torch

    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset
    from r1fit.models.load import load_policy

    def make(lora_r: int = 0):
        model, processor = load_policy(str(tiny_dir), lora_r=lora_r, lora_alpha=16,
                                       lora_dropout=0.0, lora_target="all-linear",
                                       freeze_vision=False, dtype="float32",
                                       device=torch.device("cpu"), gradient_checkpointing=True)
        data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                            max_images=1, max_bad_fraction=0.0, seed=0, size=16)
        prompts = encode_prompts(processor, [data[i] for i in range(3)], "Think, then answer.")
        for p in prompts:  # pixels in float64 like the model under test
            p.image_inputs["pixel_values"] = p.image_inputs["pixel_values"].double()
        rows = [p for p in prompts for _ in range(2)]
        gen = torch.Generator().manual_seed(0)
        vocab = len(processor.tokenizer)
        completions = [torch.randint(10, vocab - 30, (3 + (i * 5) % 7,), generator=gen)
                       for i in range(len(rows))]
        return model.double(), processor, rows, completions

    return make


@pytest.fixture(scope="session")
def hd32_dir(tiny_cache: Path) -> Path:
    """builtin:tiny-hd32 (tiny with 32-dim attention heads, which vLLM's CPU attention runs),
    built into the session cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        return ensure_builtin("tiny-hd32")


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skip the test when vLLM is not installed (CI installs it: .ci/install_vllm_cpu.sh)."""
    pytest.importorskip("vllm", reason="rollout.engine=vllm tests need vLLM: pip install -e "
                        "'.[vllm]' (GPU) or bash .ci/install_vllm_cpu.sh (CPU)")
