"""The measured patch-embedding workspace, at the tower's own width: what a direct measurement of
the convolution's backward finds beyond its weight's gradient, and, measured at a realistic
width, nearly the same at one thread and at two (the 16-channel figure it was once scaled up
from was 84 KB at one thread and 159 KB at two, bfloat16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from r1fit.memory.planner.kernels import conv_backward_workspace
from r1fit.memory.probe import TensorProbe

measure = conv_backward_workspace.__wrapped__  # uncached: each call measures


@pytest.mark.parametrize("kernel", [(2, 14, 14), (2, 16, 16), (16, 16)])
def test_workspace_matches_a_direct_measurement(kernel):
    conv_class = nn.Conv3d if len(kernel) == 3 else nn.Conv2d
    conv = conv_class(3, 64, kernel_size=kernel, stride=kernel, bias=False)
    patches = torch.randn(8, 3, *kernel)
    probe = TensorProbe()
    probe.start()
    before = probe.before_bytes
    conv(patches).sum().backward()
    # the 64-channel backward beyond its gradient (its output and input grad are a few KB)
    direct = probe.peak() - before - conv.weight.numel() * 4
    got = conv_backward_workspace(3, 64, kernel, 4)
    assert got > 0 and abs(got - direct) <= 0.05 * direct + 16 * 1024


def test_workspace_at_the_towers_width_hardly_depends_on_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = measure(3, 64, (2, 14, 14), 2)
        torch.set_num_threads(2)
        two = measure(3, 64, (2, 14, 14), 2)
    finally:
        torch.set_num_threads(threads)
    # about two weights' worth in bfloat16 (64 x 1,176 x 2 bytes each), at either count
    weight = 64 * 3 * 2 * 14 * 14 * 2
    assert 1.9 * weight <= one <= 2.2 * weight and abs(two - one) <= 0.05 * one
