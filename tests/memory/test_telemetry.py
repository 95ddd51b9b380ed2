import sys

import pytest
import torch

from r1fit.memory.telemetry import current_rss_bytes, peak_memory_bytes, reset_peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="clear_refs is Linux-only")
def test_reset_peak_starts_a_new_window():
    cpu = torch.device("cpu")
    block = bytearray(300 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
    del block
    high = peak_memory_bytes(cpu)
    assert high >= 300 * 2**20
    assert reset_peak(cpu)
    after = peak_memory_bytes(cpu)
    assert after < high - 200 * 2**20
    assert after >= current_rss_bytes() * 0.9
