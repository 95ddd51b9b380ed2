"""The process's random generators: seeding at start-up and their state for checkpoints."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def rng_untouched(device: torch.device | str | None = None) -> Iterator[None]:
    """The block's random draws leave torch's global generators as they were: the CPU's, and the
    CUDA device's when ``device`` is one. For probes and measurements (a FLOP/s matmul, the
    planner's kernel probes) that draw random tensors in one process and not another, or at
    another step after a resume: LoRA's dropout and every other draw of a run read the global
    generators, and a resumed run is bit-exact only when nothing else moved them."""
    where = torch.device(device) if device is not None else None
    cuda = []
    if where is not None and where.type == "cuda":
        cuda = [where.index if where.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        yield


#: cuBLAS's deterministic workspace setting (its docs' "Results reproducibility"); read when
#: cuBLAS creates its handle, i.e. at the first matmul of the process
CUBLAS_DETERMINISTIC = ":4096:8"


def use_deterministic_kernels(on: bool) -> None:
    """``train.deterministic``: torch's deterministic algorithms (``warn_only``: an op that has
    no deterministic kernel runs anyway and torch warns naming it, rather than stopping a run),
    cuDNN's deterministic convolutions without autotuning, and cuBLAS's fixed workspace (unless
    ``CUBLAS_WORKSPACE_CONFIG`` is set already). Off: torch's defaults."""
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)


class RngState:
    """Python, NumPy, torch CPU and (when present) CUDA generator states of this process.

    Saved per rank (``storage``). Where a checkpoint cannot give this rank its own states (it was
    saved by another number of processes, or it is weights-only), :meth:`restart` seeds fresh
    streams from the run's seed, the step and the rank."""

    storage = "per_rank"
    restartable = True

    def __init__(self, seed: int = 0, rank: int = 0) -> None:
        self.seed, self.rank = seed, rank

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"]),
                      "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the run's device only (the current one: r1fit.processes sets it), not every
            # visible one: restored by position, those would not survive a resume where fewer
            # GPUs are visible or they are listed in another order
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        torch.set_rng_state(state["torch"])
        saved = state.get("cuda")
        if isinstance(saved, (list, tuple)):  # a checkpoint of every visible device's states
            index = torch.cuda.current_device() if torch.cuda.is_available() else len(saved)
            saved = saved[index] if index < len(saved) else None
        if saved is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved)

    def restart(self, point: Any) -> str:
        """New streams for resuming at ``point`` (a ResumePoint) without this rank's saved
        states; returns what that means for the run."""
        seed_everything(self.seed + point.step + 7919 * self.rank)
        return "the RNG states are re-seeded"
