"""``parallelize()``: activation checkpointing, then FSDP2, applied from outside to a model that
knows nothing of parallelism (the torchtitan recipe); plus ``materialize()`` (rank-0 loading) and
``gathered()`` (whole parameters for generation).

Sharding units are the model's own "do not split" blocks (``_no_split_modules``: the decoder layers
and vision blocks of Qwen2-VL / Qwen2.5-VL, and of any other transformers VLM), then the root,
which owns what is left (embeddings, LM head, final norm, vision patch embedding and merger). The
root must be the module whose ``forward`` the loops call, so that FSDP gathers the root's
parameters around it: r1fit calls a small wrapper that computes completion log-probs with the LM
head in chunks (:class:`r1fit.models.logprobs.CompletionLogProbs`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from r1fit.models.load import enable_checkpointing, unwrap
from r1fit.processes import World

log = logging.getLogger("r1fit.distributed")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one: instances of the model's ``_no_split_modules``."""
    names = set(getattr(unwrap(model), "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise TypeError(f"{type(unwrap(model)).__name__} names no _no_split_modules; r1fit "
                        "cannot tell its layers apart for FSDP")
    return units


def parallelize(root: nn.Module, *, activation_checkpointing: bool, world: World,
                device_type: str, checkpoint_every: int = 1) -> nn.Module:
    """Activation checkpointing (when asked, on every ``checkpoint_every``-th layer:
    :func:`r1fit.models.load.enable_checkpointing`), then, over several processes, FSDP2: every unit of
    :func:`shard_units`, then ``root``. Gradients are summed over ranks, not averaged: each rank's
    loss is already its share of the whole batch's loss. Returns ``root``.

    On CUDA parameters are gathered in bfloat16 when they are stored in float32 (full-precision
    master weights, bf16 compute) and gradients reduced in float32. On CPU nothing is cast."""
    if activation_checkpointing:
        enable_checkpointing(root, checkpoint_every)
    if not world.distributed:
        return root
    policy = MixedPrecisionPolicy()
    if device_type == "cuda":
        stored = next(root.parameters()).dtype
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if stored == torch.float32 else None,
            reduce_dtype=torch.float32)
    # the mesh on the run's own device type: without one FSDP2 builds it on the machine's
    # accelerator (CUDA on a GPU host even for train.device=cpu, unsharded weights landing there)
    mesh = init_device_mesh(device_type, (world.size,))
    units = shard_units(root)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    if world.main:  # what ran, for a reader of the log (benchmarks/gpu_check.py's fsdp stage)
        log.info("FSDP2: %d units and the root sharded over %d process%s on %s; gathered in %s, "
                 "gradients reduced in %s", len(units), world.size, "es" * (world.size > 1),
                 mesh.device_type, _dtype_name(policy.param_dtype, root),
                 _dtype_name(policy.reduce_dtype, root))
    for method in ("generate", "prefill"):  # generation enters through the root too
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # a plain SUM (gloo has no pre-multiplied sum), divided by 1
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def _dtype_name(dtype: torch.dtype | None, root: nn.Module) -> str:
    """A mixed-precision policy's dtype by name; None (not cast): the stored ones (a bf16 model's
    float32 LoRA adapters among them)."""
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    stored = sorted({str(p.dtype).removeprefix("torch.") for p in root.parameters()})
    return " and ".join(stored) + " as stored"


def fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def materialize(root: nn.Module, model: nn.Module, source: nn.Module | None,
                device: torch.device) -> None:
    """Give a sharded model built on the meta device its weights, read by rank 0 only.

    ``source`` is the same model with real weights on rank 0 (None elsewhere). Each rank allocates
    only its shards; rank 0 sends each rank just its shard of every parameter (FSDP2 splits dim 0
    as ``torch.chunk`` does), then broadcasts the buffers that are not in the state dict (rotary
    frequencies). No rank but 0 ever holds a whole tensor: ``set_model_state_dict(
    broadcast_from_rank0=True)`` received every tensor whole on every rank before keeping the
    shard. ``model`` is the (peft or transformers) model inside ``root``."""
    root.to_empty(device=device)
    rank, size = dist.get_rank(), dist.get_world_size()
    nccl = dist.get_backend() == "nccl"
    full = dict(source.named_parameters()) if source is not None else {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if rank == 0:
                whole = full[name].detach()
                parts = (torch.chunk(whole, size, dim=0) if isinstance(param, DTensor)
                         else [whole] * size)
                for dst in range(1, min(size, len(parts))):
                    if parts[dst].numel():
                        dist.send(parts[dst].contiguous().to("cuda" if nccl else "cpu"), dst=dst)
                if local.numel():
                    local.copy_(parts[0])
            elif local.numel():
                comm = torch.empty_like(local, device="cuda") if nccl else local
                dist.recv(comm, src=0)
                if comm is not local:
                    local.copy_(comm)
        source_buffers = dict(source.named_buffers()) if source is not None else {}
        for name, buffer in model.named_buffers():
            if source is not None:
                buffer.copy_(source_buffers[name])
            comm = buffer.to("cuda") if nccl else buffer
            dist.broadcast(comm, src=0)
            if comm is not buffer:
                buffer.copy_(comm)


@contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Whole (unsharded) parameters on every rank for the duration of the block.

    Generation calls the model once per token and ranks finish their completions at different
    lengths, so it must not run collectives per forward: gather every unit once before, keep it
    through the block's forwards, shard again after. A no-op without FSDP."""
    modules = fsdp_modules(root)
    if not modules:
        yield
        return
    handles = [m.unshard(async_op=True) for m in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()
    # the root never reshards after forward (FSDP keeps it for the backward); the units do
    units = [m for m in modules if m is not root]
    for m in units:
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in units:
            m.set_reshard_after_forward(True)
        for m in modules:
            m.reshard()
