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
