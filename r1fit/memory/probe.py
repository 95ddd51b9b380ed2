"""The probe: the true peak of live tensor memory of a real step on CPU.

CUDA reports it natively (``torch.cuda.max_memory_allocated``). On CPU, process RSS mixes in the
Python heap, libraries and memory glibc keeps after frees, so it cannot be compared with a
prediction of tensor bytes; this probe can. ``memory.cpu_peak: tensors`` makes every step's
``peak_memory_bytes`` this figure (r1fit.memory.telemetry), and benchmarks/plan_accuracy.py compares
it with ``r1fit plan``.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import warnings
from typing import Any

import torch

from r1fit.report.profile import native_stderr_quiet


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (CPU; each storage counted once):
    parameters, gradients, optimizer states, buffers, anything a Python object holds."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated torch proxies warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu":
            try:  # tensors without storage, or without data (a FakeTensor left by compile)
                storage = obj.untyped_storage()
                if storage.nbytes():
                    seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return sum(seen.values())


class TensorProbe:
    """Measures the true peak of live tensor bytes on CPU between ``start()`` and ``peak()``:
    what was alive at the start (:func:`live_tensor_bytes`) plus the highest running sum of the
    bytes allocated (+) and freed (-) after it, from the torch profiler's memory events
    (``profile_memory``).
    Frees of tensors allocated while no profiler ran (the model load, say) carry no size, so the
    figure can only err high, by at most what the window freed of those. Costs profiler time on
    every op."""

    def __init__(self) -> None:
        # the profiler's C++ (kineto) logs are noise here, and on a machine without a GPU they
        # include an "ERROR: gpuGetDeviceCount failed"; read when the profiler first starts
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self._profiler: Any = None
        self._before = 0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    @property
    def before_bytes(self) -> int:
        """Live tensor bytes when the window started."""
        return self._before

    def start(self) -> None:
        self.stop()
        gc.collect()
        self._before = live_tensor_bytes()
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with native_stderr_quiet():
            self._profiler.__enter__()

    def peak(self) -> int:
        trace = self.stop()
        events = sorted((e for e in trace.get("traceEvents", [])
                         if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                        key=lambda e: e["ts"])
        # the profiler's own "Total Allocated" runs on from earlier profiling sessions, so sum
        # this window's allocations (+) and frees (-) instead
        running = highest = 0
        for event in events:
            running += event["args"].get("Bytes", 0)
            highest = max(highest, running)
        return self._before + highest

    def stop(self) -> dict[str, Any]:
        if self._profiler is None:
            return {}
        profiler, self._profiler = self._profiler, None
        with native_stderr_quiet():
            profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            profiler.export_chrome_trace(path)
            with open(path) as f:
                return json.load(f)
