"""Kernel workspaces that a model's shapes do not tell, measured once per process on this CPU.

The vision tower's patch embedding is a convolution whose stride equals its kernel. On CPU its
backward allocates a workspace that depends on the kernel, not on the number of patches: about
one weight's worth for Qwen2.5-VL's 2x14x14 kernel, about eight for Qwen3-VL's 2x16x16 (measured
with torch 2.14: oneDNN picks another algorithm). It is small for a real tower (tens of MiB) but
a large part of a tiny model's step, so the planner measures it rather than guessing. On CUDA the
cuDNN workspace is not modelled.
"""

from __future__ import annotations

import functools

#: output channels of the measured convolution; the workspace grows linearly with them
_CHANNELS = 16


@functools.cache
def conv_backward_workspace_per_channel(in_channels: int, kernel: tuple[int, ...],
                                        element_bytes: int) -> int:
    """Bytes per output channel that a patch-embedding convolution's backward allocates beyond
    its weight's gradient, on CPU (0 when it allocates less)."""
    import torch
    from torch import nn

    from r1fit.memory.probe import TensorProbe

    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    conv_class = nn.Conv3d if len(kernel) == 3 else nn.Conv2d
    with torch.random.fork_rng(devices=[]):
        conv = conv_class(in_channels, _CHANNELS, kernel_size=kernel, stride=kernel, bias=False,
                          dtype=dtype)
        patches = torch.randn(2, in_channels, *kernel, dtype=dtype)
    probe = TensorProbe()
    probe.start()
    before = probe.before_bytes
    conv(patches).sum().backward()
    grown = probe.peak() - before
    weight = conv.weight.numel() * conv.weight.element_size()
    return max(0, grown - weight) // _CHANNELS
