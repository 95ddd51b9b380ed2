"""The decode step that rollout.engine=static captures as a CUDA graph makes no host
synchronisation and takes no host data, on every built-in family and in every layout: such an
operation (``.item()``, ``bool(tensor)``, ``nonzero``, a boolean index, ``torch.tensor(list)``)
is refused while a CUDA stream is capturing, so it would stop the engine on its first GPU step.
Checked on CPU by watching the step's aten operations (a dispatch mode), in the shapes a
captured step runs (the whole buffer length)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from r1fit.rollout.generate import SamplingSettings, row_seeds
from r1fit.rollout.static_engine import StaticDecoder

from .test_static_engine import CPU, FAMILIES, setup

#: aten operations that wait for the device (their result's size or value is read on the host)
#: or copy host data to it; each is refused during CUDA graph capture
HOST_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2",
                      "unique_consecutive", "unique_dim_consecutive", "lift_fresh",
                      "lift_fresh_copy", "bincount", "histc"})
INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


class HostOps(TorchDispatchMode):
    """Records the host-synchronising aten operations run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        if name in HOST_OPS or boolean_index or (
                name == "repeat_interleave" and (kwargs or {}).get("output_size") is None):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class Watched(StaticDecoder):
    """The engine with each decode step run under :class:`HostOps`, at the captured shapes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watched_steps = 0
        self.host_ops: list[str] = []

    def _step(self, model, rows, settings, out, upto=None):
        with HostOps() as mode:
            super()._step(model, rows, settings, out, None)
        self.watched_steps += 1
        self.host_ops.extend(mode.seen)


def test_the_watch_sees_a_host_synchronisation():
    """The watch itself: each kind of operation it looks for is seen."""
    x = torch.arange(6.0)
    with HostOps() as mode:
        bool(x.sum() > 0)
        x.nonzero()
        x[x > 2]
        torch.tensor([1, 2])
        x.repeat_interleave(torch.tensor(2))
        x + 1  # not a host operation
    assert mode.seen == ["aten._local_scalar_dense.default", "aten.nonzero.default",
                         "aten.index.Tensor", "aten.lift_fresh.default",
                         "aten.lift_fresh.default", "aten.repeat_interleave.Tensor"], mode.seen


SETTINGS = {
    "greedy": SamplingSettings(max_new_tokens=6, greedy=True),
    "sampled": SamplingSettings(max_new_tokens=6, temperature=0.9, top_p=0.8, min_new_tokens=3),
}


@pytest.mark.parametrize("sampling", sorted(SETTINGS))
@pytest.mark.parametrize("share_prompt", [False, True], ids=["rows", "shared-prompts"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_step_makes_no_host_synchronisation(family, share_prompt, sampling,
                                                     builtin_folder, tiny_dir):
    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder, indices=(0, 2), copies=2)
    settings = SETTINGS[sampling]
    engine = Watched(model, ids, CPU, share_prompt=share_prompt, prompt_places=2)
    seeds = None if settings.greedy else row_seeds(3, 1, 0, len(rows))
    engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
    assert engine.watched_steps >= settings.max_new_tokens - 1
    assert engine.host_ops == [], sorted(set(engine.host_ops))
