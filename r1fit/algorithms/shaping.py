"""Reward shaping by completion length: DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, *, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's ``R_length``, times ``penalty``, per completion (``[N]`` float32; 0 everywhere when ``buffer`` is 0).

    With ``L_max = max_new_tokens``, ``L_cache = buffer`` and a completion of ``|y|`` tokens:
    0 when ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer, so
    linear from 0 down to -1 at ``|y| = L_max``; -1 beyond ``L_max`` (only reachable when the lengths
    come from elsewhere: generation stops at ``L_max``). ``|y|`` counts the end-of-sequence token when
    the completion has one, as verl's response length does.
    """
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D [N], got shape {tuple(lengths.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    expected = max_new_tokens - buffer
    exceed = lengths.float() - expected
    return penalty * (-exceed / buffer).clamp(min=-1.0, max=0.0)
