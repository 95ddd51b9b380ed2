"""The measured patch-embedding workspace: per output channel, so a wide tower's is the measured
figure times its width (checked against a direct measurement of a 64-channel convolution)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from r1fit.memory.planner.kernels import conv_backward_workspace_per_channel
from r1fit.memory.probe import TensorProbe


@pytest.mark.parametrize("kernel", [(2, 14, 14), (2, 16, 16), (16, 16)])
def test_workspace_scales_with_output_channels(kernel):
    conv_class = nn.Conv3d if len(kernel) == 3 else nn.Conv2d
    conv = conv_class(3, 64, kernel_size=kernel, stride=kernel, bias=False)
    patches = torch.randn(8, 3, *kernel)
    probe = TensorProbe()
    probe.start()
    before = probe.before_bytes
    conv(patches).sum().backward()
    # the 64-channel backward beyond its gradient (its output and input grad are a few KB)
    direct = probe.peak() - before - conv.weight.numel() * 4
    per_channel = conv_backward_workspace_per_channel(3, kernel, 4)
    assert per_channel >= 0
    assert abs(64 * per_channel - direct) <= 0.1 * direct + 64 * 1024
