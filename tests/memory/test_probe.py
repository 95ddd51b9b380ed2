"""The tensor probe measures the peak of live tensor bytes, not RSS."""

from __future__ import annotations

import torch

from r1fit.memory.probe import TensorProbe, live_tensor_bytes
from r1fit.memory.telemetry import peak_memory_bytes, reset_peak, use_tensor_probe


def test_peak_is_what_was_alive_plus_the_highest_running_total():
    kept = torch.zeros(250_000)  # 1 MB alive before the window
    probe = TensorProbe()
    probe.start()
    before = probe._before
    a = torch.zeros(2_000_000)   # +8 MB
    b = torch.zeros(4_000_000)   # +16 MB -> 24 MB: the peak
    del b
    c = torch.zeros(1_000_000)   # +4 MB after 16 MB were freed: 12 MB
    assert probe.peak() - before == 24_000_000
    assert before >= kept.nbytes and not probe.active
    del a, c


def test_live_tensor_bytes_counts_shared_storage_once():
    base = live_tensor_bytes()
    x = torch.zeros(1_000_000)
    view = x[:10]  # same storage
    assert live_tensor_bytes() - base == 4_000_000
    del x, view


def test_telemetry_switches_cpu_peak_to_tensors():
    cpu = torch.device("cpu")
    use_tensor_probe(True)
    try:
        reset_peak(cpu)
        block = torch.ones(3_000_000)
        tensors_peak = peak_memory_bytes(cpu)
        del block
    finally:
        use_tensor_probe(False)
    # live tensors of this test process, far below its resident memory
    assert 12_000_000 <= tensors_peak < peak_memory_bytes(cpu)


def test_windows_are_independent():
    first = TensorProbe()
    first.start()
    kept = torch.zeros(2_000_000)  # allocated in the first window and kept
    first.peak()
    second = TensorProbe()
    second.start()
    before = second._before
    extra = torch.zeros(250_000)
    assert second.peak() - before == 1_000_000  # not 9 MB: earlier windows do not leak in
    del kept, extra


def test_the_profilers_native_lines_do_not_reach_the_console():
    """kineto prints 'USDT: ... profiler_start/stop' on fd 2 at every start and stop; the probe
    quiets fd 2 for just those calls, and what is written before and after still arrives."""
    import subprocess
    import sys

    script = ("import os, sys\n"
              "from r1fit.memory.probe import TensorProbe, native_stderr_quiet\n"
              "print('before', file=sys.stderr, flush=True)\n"
              "with native_stderr_quiet():\n"
              "    os.write(2, b'native noise\\n')\n"
              "probe = TensorProbe(); probe.start(); probe.peak()\n"
              "print('after', file=sys.stderr, flush=True)\n")
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stderr
    assert err.splitlines()[0] == "before" and err.splitlines()[-1] == "after"
    assert "native noise" not in err and "USDT" not in err
