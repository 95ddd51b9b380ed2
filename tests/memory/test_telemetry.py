import os
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM/clear_refs are Linux-only")
def test_child_peak_is_not_inherited_from_a_big_parent(tmp_path):
    """ru_maxrss of a child starts at its parent's peak; the per-step peak must not."""
    import subprocess

    child = ("import torch; from r1fit.memory.telemetry import peak_memory_bytes, reset_peak; "
             "reset_peak(torch.device('cpu')); print(peak_memory_bytes(torch.device('cpu')))")
    parent = ("import subprocess, sys; block = bytearray(800 * 2**20); block[::4096] = b'x' * "
              "len(block[::4096]); print(subprocess.run([sys.executable, '-c', sys.argv[1]], "
              "capture_output=True, text=True, check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent, child], capture_output=True, text=True,
                         check=True).stdout
    assert int(out.strip()) < 700 * 2**20


def test_cuda_allocator_gets_expandable_segments_unless_configured(monkeypatch):
    from r1fit.memory.telemetry import configure_cuda_allocator

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # the user's wins


def test_step_memory_on_cpu_has_no_reserved_figure():
    from r1fit.memory.telemetry import step_memory, warn_if_fragmented

    cpu = torch.device("cpu")
    row = step_memory(cpu, "eval/")
    assert row["eval/peak_memory_bytes"] > 0 and row["eval/peak_reserved_bytes"] is None
    assert warn_if_fragmented(cpu, 0.001, step=1) is False
