"""Adapters that give the pieces of a run a ``state_dict()`` / ``load_state_dict()`` pair.

The checkpoint manager saves any object with that pair; these cover what has none (the RNGs, loop
counters) or whose own pair is keyed by position rather than by name (the optimizer).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from r1fit.checkpoint.sharded import load_tensors, saved_keys


class OptimizerState:
    """An optimizer's state keyed by parameter name (not position), so it survives a different
    parameter order or process count; built on ``torch.distributed.checkpoint.state_dict``.

    Stored ``sharded``: the checkpoint manager writes the moments through DCP, each rank its own
    shards, and the param groups as JSON; :meth:`load_sharded` reads them back into any number of
    processes. ``restartable``: a weights-only checkpoint leaves it out, and the run continues
    with a fresh optimizer."""

    storage = "sharded"
    restartable = True

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

    def sharded_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors written through DCP, the rest written as JSON)."""
        state = self.state_dict()
        return state["state"], {"param_groups": state["param_groups"]}

    def load_sharded(self, folder: Path, name: str, saved: dict[str, Any]) -> None:
        load_optimizer_sharded(self, folder, name, saved["param_groups"])

    def restart(self, point: Any) -> str:
        return "fresh optimizer"


class SchedulerState:
    """The learning-rate schedule; on a weights-only resume (no saved state) it is fast-forwarded
    to the checkpoint's update count."""

    restartable = True

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def progress(self) -> dict[str, Any]:
        """What ``trainer_state.json`` records of it."""
        return {"updates": self.scheduler.last_epoch}

    def restart(self, point: Any) -> str:
        updates = point.state.get("updates")
        if updates is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
                self.scheduler.last_epoch = int(updates) - 1
                self.scheduler.step()
        return f"the learning-rate schedule continues from update {updates}"


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
