"""Kernel workspaces that a model's shapes do not tell, measured once per process on this CPU.

The vision tower's patch embedding is a convolution whose stride equals its kernel. On CPU its
backward allocates a workspace that depends on the kernel, the output channels and the threads,
not on the number of patches (torch 2.14, oneDNN, measured): for Qwen2.5-VL's 2x14x14 kernel
about one weight's worth in float32 and two in bfloat16; for Qwen3-VL's 2x16x16 in float32 four
per thread (a partial weight gradient each). It is small for a real tower (tens of MiB) but a
large part of a tiny model's step, so the planner measures it rather than guessing, at the
tower's own width and with this process's threads: scaled up from 16 output channels it had
depended on the thread count even where the real one does not (bfloat16, 2x14x14: 84 KB at one
thread and 159 KB at two for 16 channels, against 310 and 319 KB for 64). On CUDA the cuDNN
workspace is not modelled.
"""

from __future__ import annotations

import functools


@functools.cache
def conv_backward_workspace(in_channels: int, out_channels: int, kernel: tuple[int, ...],
                            element_bytes: int) -> int:
    """Bytes that a patch-embedding convolution's backward allocates beyond its weight's gradient,
    on CPU (0 when it allocates less), measured on a patch per thread (so that every thread
    holds its share, as in a real step's backward)."""
    import torch
    from torch import nn

    from r1fit.memory.probe import TensorProbe

    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    conv_class = nn.Conv3d if len(kernel) == 3 else nn.Conv2d
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays where it was
        conv = conv_class(in_channels, out_channels, kernel_size=kernel, stride=kernel,
                          bias=False, dtype=dtype)
        patches = torch.randn(max(2, torch.get_num_threads()), in_channels, *kernel, dtype=dtype)
    probe = TensorProbe()
    probe.start()
    before = probe.before_bytes
    conv(patches).sum().backward()
    grown = probe.peak() - before
    weight = conv.weight.numel() * conv.weight.element_size()
    return max(0, grown - weight)
