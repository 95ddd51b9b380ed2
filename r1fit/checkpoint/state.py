"""Adapters that give the pieces of a run a ``state_dict()`` / ``load_state_dict()`` pair.

The checkpoint manager saves any object with that pair; these cover what has none (the RNGs, loop
counters) or whose own pair is keyed by position rather than by name (the optimizer).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from r1fit.checkpoint.sharded import load_tensors, saved_keys


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RngState:
    """Python, NumPy, torch CPU and (when present) CUDA generator states of this process."""

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"]),
                      "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))


class OptimizerState:
    """An optimizer's state keyed by parameter name (not position), so it survives a different
    parameter order or process count; built on ``torch.distributed.checkpoint.state_dict``.

    ``sharded``: the checkpoint manager writes the moments (``state``) through DCP, each rank its
    own shards, and the param groups as JSON; :meth:`load_sharded` reads them back into any number
    of processes."""

    sharded = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = [p for g in self.state_dict()["param_groups"] for p in g["params"]]
        saved = [p for g in state["param_groups"] for p in g["params"]]
        if current != saved:
            only_saved = sorted(set(saved) - set(current))[:3]
            only_now = sorted(set(current) - set(saved))[:3]
            raise ValueError(f"the optimizer was saved for other parameters ({len(saved)} saved, "
                             f"{len(current)} now; only saved: {only_saved}, only now: {only_now})")
        # not strict: a parameter that never received a gradient has no state yet, which is
        # legitimate; the parameter lists were compared above
        set_optimizer_state_dict(self.model, self.optimizer, state,
                                 options=StateDictOptions(strict=False))


class Counters:
    """Named numbers a loop carries from step to step (best eval, counts of skipped rows...)."""

    def __init__(self, **values: float) -> None:
        self.__dict__.update(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(self.__dict__)
        if unknown:
            raise ValueError(f"unknown loop counters {sorted(unknown)}")
        self.__dict__.update(state)


class PythonRandomState:
    """A ``random.Random`` instance of the loop's own (not the global one)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["state"])


def load_optimizer_sharded(holder: OptimizerState, folder: Path, name: str,
                           groups: list[dict[str, Any]]) -> None:
    """Restore ``holder``'s optimizer from checkpoint ``folder``: moments from its DCP shards
    (resharded to this process count), param groups (names, hyper-parameters) from JSON.

    DCP loads into tensors of the right shapes and shards, so a fresh optimizer needs its state
    first: ``get_optimizer_state_dict`` creates it (one step with zero gradients at learning rate
    0, which leaves the parameters as they are); the loaded values then replace it all."""
    state = holder.state_dict()["state"]
    keys = saved_keys(folder)
    # a parameter that never had a gradient has no saved state; it gets none here either
    present = {fqn: v for fqn, v in state.items() if any(f"{name}.{fqn}.{k}" in keys for k in v)}
    load_tensors(folder, {name: present})
    holder.load_state_dict({"state": present, "param_groups": groups})
    for fqn, param in holder.model.named_parameters():
        if fqn in state and fqn not in present:
            holder.optimizer.state.pop(param, None)
