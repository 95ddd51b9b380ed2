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
    """ru_maxrss of a child starts at its parent's peak; the per-step peak must not. (A child
    that imports torch 2.14.1's CUDA wheel holds ~714 MB by itself here: the parent's block is
    2 GiB, so an inherited peak stands far above a child's own.)"""
    import subprocess

    child = ("import torch; from r1fit.memory.telemetry import peak_memory_bytes, reset_peak; "
             "reset_peak(torch.device('cpu')); print(peak_memory_bytes(torch.device('cpu')))")
    parent = ("import subprocess, sys; block = bytearray(2048 * 2**20); block[::4096] = b'x' * "
              "len(block[::4096]); print(subprocess.run([sys.executable, '-c', sys.argv[1]], "
              "capture_output=True, text=True, check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent, child], capture_output=True, text=True,
                         check=True).stdout
    assert int(out.strip()) < 1536 * 2**20


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


# A child process: glibc's mmap threshold is process-wide and cannot be unset. It frees a mapped
# 20 MiB block (glibc's dynamic threshold then rises to 20 MiB), then allocates 4 MiB
# temporaries each followed by a 256 KiB tensor that stays (10 MiB in all), frees the
# temporaries, and prints whether the setting took, the bytes a 4 MiB tensor got mapped for, and
# the RSS the freed temporaries still hold.
HOST_ALLOCATOR_CHILD = """
import ctypes, json, logging, sys
import torch
from r1fit.memory.telemetry import configure_host_allocator, current_rss_bytes

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
release, budget, device = json.loads(sys.argv[1])
took = configure_host_allocator(release, budget, torch.device(device))
big = torch.ones(20 * 2**20 // 4)
del big
before = libc.mallinfo2().hblkhd
probe = torch.ones(2**20)
mapped = libc.mallinfo2().hblkhd - before
del probe
rss = current_rss_bytes()
temps, kept = [], []
for _ in range(40):
    temps.append(torch.ones(2**20))
    kept.append(torch.ones(2**16))  # 256 KiB: from the heap either way
del temps
print(json.dumps([took, mapped, current_rss_bytes() - rss]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize(("release", "budget", "device", "env", "takes"), [
    (True, "", "cpu", None, True),
    ("auto", "8GiB", "cpu", None, True),
    ("auto", "", "cpu", None, False),
    ("auto", "8GiB", "cuda", None, False),  # CUDA memory is the caching allocator's
    (False, "8GiB", "cpu", None, False),
    (True, "", "cpu", "33554432", False),  # the user's MALLOC_MMAP_THRESHOLD_ wins
])
def test_release_freed_hands_large_freed_blocks_back(release, budget, device, env, takes):
    import json
    import subprocess

    child_env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if env is not None:
        child_env["MALLOC_MMAP_THRESHOLD_"] = env
    out = subprocess.run([sys.executable, "-c", HOST_ALLOCATOR_CHILD,
                          json.dumps([release, budget, device])], capture_output=True, text=True,
                         check=True, env=child_env).stdout
    took, mapped, held = json.loads(out.strip().splitlines()[-1])
    assert took is takes
    if takes:  # the 4 MiB tensor has pages of its own; the freed temporaries left the RSS
        assert mapped >= 4 * 2**20
        assert held < 16 * 2**20
    else:  # from glibc's heap
        assert mapped == 0
        if env is None:  # glibc's dynamic threshold keeps the 160 MiB of freed temporaries
            assert held > 120 * 2**20
