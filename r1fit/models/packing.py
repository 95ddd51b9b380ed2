"""Whether a model's log-probs hold when its sequences are packed (:mod:`r1fit.models.prefix`):
the packed path against the per-row one on a batch, within a per-token tolerance. Its own
module because it runs both paths (:mod:`r1fit.models.logprobs`, which takes a packed batch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from r1fit.data.batch import Prompt, collate
from r1fit.models.load import compute_dtype, is_16_bit
from r1fit.models.logprobs import completion_logprobs
from r1fit.models.prefix import pack_groups

#: the most a completion token's log-prob may differ between the packed and per-row paths in a
#: float32 or float64 model (float rounding between batch shapes: below 2e-6 on the built-ins)
TOLERANCE = 1e-4
#: the same in a 16-bit model, where rounding between batch shapes alone moves a log-prob by up
#: to 4e-3 (bfloat16 on the built-ins; 5e-4 in float16), while Gemma 3's bidirectional image
#: attention, which packing breaks, moves it by 0.3 in every dtype. With 1e-4, 16-bit built-ins
#: failed the check on rounding alone (sharing off, packing refused). What this cannot see in
#: 16-bit is a change as small as a random-weight model's response to wrong positions (float64
#: tests cover those)
HALF_TOLERANCE = 0.05
#: above those bounds, the packed path still counts as exact when it is within this many times
#: the per-row path's own rounding between batch shapes (:func:`per_row_noise`: the same rows
#: batched vs one at a time), the scale below which no path can be told from the per-row one.
#: A bigger model in 16-bit rounds far above ``HALF_TOLERANCE``: Qwen2.5-VL-3B in bfloat16 on an
#: H100 gave 0.125 packed vs 0.113 per row against itself (benchmarks/RESULTS.md, numerics), so a
#: fixed bound turned sharing off where it is as exact as the per-row path. On the built-ins
#: (float32, bfloat16, float16) the packed distance was at most 1.0x the noise; Gemma 3's broken
#: bidirectional image attention 160x and more (tests/models/test_packing.py)
NOISE_FACTOR = 4.0


def packing_tolerance(model: nn.Module) -> float:
    """The per-token bound :func:`packing_is_exact` holds ``model`` to: ``HALF_TOLERANCE`` in a
    16-bit model, else ``TOLERANCE``."""
    return HALF_TOLERANCE if is_16_bit(model) else TOLERANCE


def packing_distance(model: nn.Module, prompts: Sequence[Prompt],
                     groups: Sequence[Sequence[torch.Tensor]], pad_id: int, *, chunk_size: int,
                     one_row: bool = False) -> float:
    """The largest absolute difference of a completion token's log-prob between these groups
    packed (:func:`pack_groups` with ``one_row``) and the per-row path (NaN when either gives
    NaN)."""
    per_row = _per_row_logprobs(model, prompts, groups, pad_id, chunk_size)[2]
    return _distance(model, prompts, groups, pad_id, chunk_size, one_row, per_row)


def per_row_noise(model: nn.Module, prompts: Sequence[Prompt],
                  groups: Sequence[Sequence[torch.Tensor]], pad_id: int, *,
                  chunk_size: int) -> float:
    """The per-row path against itself: the largest absolute difference of a completion token's
    log-prob between the rows of these groups in one padded batch (the per-row side of
    :func:`packing_distance`) and each row run alone (NaN when either gives NaN). Rounding between
    batch shapes only, so the scale below which no other path can be told from the per-row one in
    this dtype on this device (``r1fit doctor --check`` prints it beside the distance)."""
    return _noise(model, pad_id, chunk_size,
                  *_per_row_logprobs(model, prompts, groups, pad_id, chunk_size))


def _distance(model: nn.Module, prompts: Sequence[Prompt],
              groups: Sequence[Sequence[torch.Tensor]], pad_id: int, chunk_size: int,
              one_row: bool, per_row: torch.Tensor) -> float:
    """:func:`packing_distance` from the per-row path's log-probs ``per_row``."""
    device = next(model.parameters()).device
    with torch.no_grad():
        packed = pack_groups(model, prompts, groups, pad_id, compute_dtype(model),
                             one_row=one_row).to(device)
        shared = completion_logprobs(model, packed, chunk_size=chunk_size)
    width = min(per_row.shape[1], shared.shape[1])
    return float((per_row[:, :width] - shared[:, :width]).abs().max())


def _noise(model: nn.Module, pad_id: int, chunk_size: int, rows: Sequence[Prompt],
           completions: Sequence[torch.Tensor], batched: torch.Tensor) -> float:
    """:func:`per_row_noise` from the per-row path's ``rows``, ``completions`` and their
    log-probs in one batch, ``batched``."""
    device = next(model.parameters()).device
    worst = torch.zeros(())
    with torch.no_grad():
        for i, (row, completion) in enumerate(zip(rows, completions)):
            alone = completion_logprobs(model, collate([row], [completion], pad_id).to(device),
                                        chunk_size=chunk_size)
            width = min(alone.shape[1], batched.shape[1])
            gap = (batched[i, :width] - alone[0, :width]).abs().max().float().cpu()
            worst = torch.maximum(worst, gap)  # NaN propagates (max() of floats would drop it)
    return float(worst)


def _per_row_logprobs(model: nn.Module, prompts: Sequence[Prompt],
                      groups: Sequence[Sequence[torch.Tensor]], pad_id: int, chunk_size: int
                      ) -> tuple[list[Prompt], list[torch.Tensor], torch.Tensor]:
    """The per-row path over these groups: each completion's prompt, the completions, and their
    log-probs in one padded batch [rows, longest completion], no gradients."""
    rows = [p for p, g in zip(prompts, groups) for _ in g]
    completions = [c for g in groups for c in g]
    batch = collate(rows, completions, pad_id).to(next(model.parameters()).device)
    with torch.no_grad():
        return rows, completions, completion_logprobs(model, batch, chunk_size=chunk_size)


@dataclass(frozen=True)
class PackingCheck:
    """The packed path against the per-row one on a batch: the largest per-token distance of the
    log-probs (:func:`packing_distance`), the fixed tolerance (:func:`packing_tolerance`) and the
    per-row path's own rounding (:func:`per_row_noise`; None where the distance was within the
    tolerance, so it was not measured)."""

    distance: float
    tolerance: float
    noise: float | None = None

    @property
    def bound(self) -> float:
        """The tolerance, or ``NOISE_FACTOR`` times the noise where that is larger."""
        if self.noise is None or math.isnan(self.noise):
            return self.tolerance
        return max(self.tolerance, NOISE_FACTOR * self.noise)

    @property
    def exact(self) -> bool:
        """Within the bound (NaN compares False: a NaN log-prob is never exact)."""
        return self.distance <= self.bound

    def describe(self) -> str:
        """'log-probs 0.125 from the per-row path's (bound 0.452: 4x the per-row path's own
        rounding between batch shapes, 0.113)'."""
        why = f"{self.bound:g}"
        if self.noise is not None:
            own = "the per-row path's own rounding between batch shapes"
            why += (f": {NOISE_FACTOR:g}x {own}, {self.noise:.3g}"
                    if self.bound > self.tolerance else f"; {own} {self.noise:.3g}")
        return f"log-probs {self.distance:.3g} from the per-row path's (bound {why})"


def check_packing(model: nn.Module, prompts: Sequence[Prompt],
                  groups: Sequence[Sequence[torch.Tensor]], pad_id: int, *, chunk_size: int,
                  one_row: bool = False, noise: bool = False) -> PackingCheck:
    """The packed path (:func:`pack_groups` with ``one_row``) against the per-row path on these
    groups. Exact when the distance is within :func:`packing_tolerance`, or else within
    ``NOISE_FACTOR`` times the per-row path's own rounding between batch shapes (measured only
    then, or always with ``noise``: it runs each row alone). A model whose attention is not plain
    causal, or whose positions do not follow from ``get_rope_index``, moves the log-probs far
    beyond both. The per-row batch runs once for both numbers."""
    tolerance = packing_tolerance(model)
    rows, completions, batched = _per_row_logprobs(model, prompts, groups, pad_id, chunk_size)
    distance = _distance(model, prompts, groups, pad_id, chunk_size, one_row, batched)
    if not noise and (distance <= tolerance or math.isnan(distance)):
        return PackingCheck(distance, tolerance)
    return PackingCheck(distance, tolerance,
                        _noise(model, pad_id, chunk_size, rows, completions, batched))


def packing_is_exact(model: nn.Module, prompts: Sequence[Prompt],
                     groups: Sequence[Sequence[torch.Tensor]], pad_id: int, *, chunk_size: int,
                     one_row: bool = False, tolerance: float | None = None) -> bool:
    """Whether the log-probs of these groups packed (:func:`pack_groups` with ``one_row``) equal
    the per-row path's: :func:`check_packing`, or with ``tolerance`` within that fixed bound
    (absolute, per token; NaN is never exact). The distance: :func:`packing_distance`."""
    if tolerance is None:
        return check_packing(model, prompts, groups, pad_id, chunk_size=chunk_size,
                             one_row=one_row).exact
    return packing_distance(model, prompts, groups, pad_id, chunk_size=chunk_size,
                            one_row=one_row) <= tolerance
