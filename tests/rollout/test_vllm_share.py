"""The vLLM engine's start-up check of its share of a CUDA GPU (rollout.vllm.gpu_memory_utilization
without kv_cache_memory): it must hold the engine's weights and one whole sequence's KV cache,
which vLLM itself finds out only after loading the weights. No vLLM needed: the check runs first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from r1fit.config.engines import least_share
from r1fit.rollout.vllm_engine import EngineSpec, RolloutEngineError, check_share

TOTAL = 100_000_000  # bytes of the GPU
KV_PER_TOKEN = 1_000


def spec(utilization: float, weight_bytes: int, *, distributed: bool = False) -> EngineSpec:
    return EngineSpec(folder=Path("m"), dtype=torch.bfloat16, device=torch.device("cuda"), seed=0,
                      max_model_len=2_000, kv_cache_memory=None,
                      gpu_memory_utilization=utilization, sleep_level=1, enforce_eager=None,
                      max_images=1, image_token_id=7, distributed=distributed,
                      weight_bytes=weight_bytes)


def test_a_share_short_of_weights_and_one_sequence_is_refused_with_the_least_that_holds() -> None:
    # 0.3 of 100 MB = 30 MB < 29 MB of weights + 2,000 tokens x 1,000 B = 31 MB: 0.31 holds it
    with pytest.raises(RolloutEngineError) as info:
        check_share(spec(0.3, 29_000_000), KV_PER_TOKEN, TOTAL)
    assert str(info.value) == (
        "rollout.vllm.gpu_memory_utilization=0.3 gives vLLM 28.61 MiB of the GPU's 95.37 MiB, "
        "less than its copy of the weights and one sequence's KV cache (29.56 MiB): raise it "
        "to 0.31, or use rollout.engine=static or hf (a sequence: 2000 tokens)")
    check_share(spec(0.31, 29_000_000), KV_PER_TOKEN, TOTAL)  # exactly enough: no error
    check_share(spec(0.3, 28_000_000), KV_PER_TOKEN, TOTAL)  # 30 MB holds 28 + 2


def test_weights_larger_than_the_gpu_name_the_engines_that_hold_none() -> None:
    with pytest.raises(RolloutEngineError, match=r"no share of this GPU holds them: use "
                                                 r"rollout.engine=hf \(a sequence"):
        check_share(spec(0.9, 99_000_000, distributed=True), KV_PER_TOKEN, TOTAL)


def test_the_least_share_rounds_up_to_hundredths_in_whole_numbers() -> None:
    # 31,000,001 B of 100 MB: 0.31000001 -> 0.32; an exact hundredth stays (no float drift)
    assert least_share(31_000_001, TOTAL) == 0.32
    assert least_share(31_000_000, TOTAL) == 0.31
    assert least_share(7_000_000, TOTAL) == 0.07  # in floats 7e6 / 1e8 * 100 is 7.000000000000001
