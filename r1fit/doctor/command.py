"""``r1fit doctor [--json] [--check] [--out DIR]``: print the facts, run the self-check, return
the exit status (0; 1 when a check failed; 2 when it could not start)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from r1fit.doctor.env import collect_env, first_device, render_env
from r1fit.errors import R1fitError
from r1fit.report.blocks import print_blocks

if TYPE_CHECKING:  # torch's: imported where the rates are measured
    from r1fit.memory.rates import DeviceRates

log = logging.getLogger("r1fit")


def doctor(*, json_out: bool = False, check: bool = False, out: Path | None = None,
           calibrate: bool = False) -> int:
    """Print this machine's facts (``json_out``: as one JSON object); with ``check`` run the
    self-check into ``out`` (default: a temporary folder, removed when every item passes, kept
    and named when one fails) and add its verdicts; with ``calibrate`` measure the first
    device's rates for the time model and cache them. Returns 0, or 1 when an item failed."""
    if calibrate:
        return _calibrate(json_out)
    env = collect_env()
    if not check:
        if json_out:
            print(json.dumps(env, indent=2))
        else:
            render_env(env, rich=sys.stdout.isatty())
        return 0
    from r1fit.doctor.selfcheck import run_selfcheck

    if not json_out:  # the facts first: they explain a failure below
        render_env(env, rich=sys.stdout.isatty())
        sys.stdout.flush()
    folder = out if out is not None else Path(tempfile.mkdtemp(prefix="r1fit-doctor-"))
    began = time.perf_counter()
    try:
        verdicts = run_selfcheck(folder)
    except R1fitError as exc:  # e.g. --out holds files: one line, as the other commands say it
        print(f"r1fit: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - began
    ok = all(v.ok for v in verdicts)
    if out is None and ok:
        shutil.rmtree(folder, ignore_errors=True)
    if json_out:
        print(json.dumps({**env, "check": {"ok": ok, "seconds": round(seconds, 1),
                                           "out": str(folder) if out or not ok else None,
                                           "items": [v.to_dict() for v in verdicts]}}, indent=2))
    else:
        failed = sum(not v.ok for v in verdicts)
        lines = ["", f"self-check ({seconds:.0f} s): {len(verdicts) - failed} ok, {failed} failed"
                 + ("" if ok and out is None else f"; its runs are in {folder}"),
                 *(f"  {v.line()}" for v in verdicts)]
        print_blocks(lines, rich=sys.stdout.isatty())
    return 0 if ok else 1


def _layer_tokens_lines(rates: DeviceRates) -> list[str]:
    """The calibration layer over a row of tokens, per dtype, and its element-wise part."""
    from r1fit.memory.rates import LAYER_WIDTH

    lines = []
    for dtype, (tokens, forward, train) in rates.layer_tokens_s.items():
        per_token = rates.elementwise_s(dtype, LAYER_WIDTH)
        lines.append(f"decoder layer over {tokens} tokens ({dtype}): forward {forward * 1e3:.2f} "
                     f"ms, with backward {train * 1e3:.2f} ms; element-wise "
                     f"{per_token[0] * 1e6:.2f} / {per_token[1] * 1e6:.2f} us per token at width "
                     f"{LAYER_WIDTH}")
    return lines


def machine_busy() -> str | None:
    """Why the machine is too busy to measure on (the 1-minute load average of other work at half
    its cores or more), or None (also where the OS gives no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    if load < max(0.5 * cores, 1.0):
        return None
    return f"the machine was busy when it started (load {load:.1f} on {cores} cores)"


def _calibrate(json_out: bool) -> int:
    """``r1fit doctor --calibrate``: measure, cache and print the first device's rates."""
    from r1fit.doctor.steps import measure_step_fixed
    from r1fit.memory.rates import calibrate, save_calibration

    began = time.perf_counter()
    busy = machine_busy()
    rates = calibrate()
    # what only r1fit's own step can show, planned on the rates just cached
    micro_batch, update = measure_step_fixed(first_device())
    rates = replace(rates, micro_batch_s=micro_batch, update_s=update)
    doubts = rates.doubts() + ([busy] if busy else [])
    if doubts:  # kept (a rate is better than none), but said, and noted in the file
        rates = replace(rates, notes=[*rates.notes, *(f"doubt: {d}" for d in doubts)])
        for doubt in doubts:
            log.warning("r1fit doctor --calibrate: %s; the rates may be off: calibrate again "
                        "when the machine is idle", doubt)
    path = save_calibration(rates, first_device())
    if json_out:
        print(json.dumps({**rates.to_dict(), "path": str(path)}, indent=2))
        return 0
    matmul = [(dtype, f"{n}", f"{rate / 1e9:,.1f}") for dtype, curve in rates.matmul.items()
              for n, rate in curve]
    layer = ", ".join(f"{rows} rows {seconds * 1e3:.3f} ms" for rows, seconds in
                      rates.layer_step_s)
    print_blocks([f"calibrated {rates.device} in {time.perf_counter() - began:.0f} s",
                  (("matmul dtype", "size", "GFLOP/s"), matmul, {1, 2}),
                  f"copy bandwidth {rates.copy_bytes_per_s / 1e9:,.1f} GB/s (read + write)"
                  + (f", {rates.fresh_copy_bytes_per_s / 1e9:,.1f} GB/s into memory just "
                     f"allocated" if rates.fresh_copy_bytes_per_s else ""),
                  f"launch {rates.launch_s * 1e6:.1f} us per small kernel",
                  f"decoder layer step: {layer} (fixed part "
                  f"{rates.layer_overhead_s() * 1e3:.3f} ms)",
                  f"Hugging Face generate's own loop {rates.generate_step_s * 1e3:.3f} ms per "
                  f"decode step and {rates.generate_s_per_logit * 1e9:.2f} ns per logit; "
                  f"sampler {rates.sample_s_per_logit * 1e9:.2f} ns and training "
                  f"head {rates.head_s_per_logit * 1e9:.2f} ns per logit",
                  *_layer_tokens_lines(rates),
                  f"optimizer step (AdamW, clip, zeroing) {rates.optimizer_s_per_tensor * 1e6:.1f} "
                  f"us per parameter tensor; peft's unmerged LoRA adapter "
                  f"{rates.lora_s_per_linear * 1e6:.1f} us per Linear forward",
                  f"r1fit's GRPO step beyond the model: {rates.micro_batch_s * 1e3:.2f} ms per "
                  f"training micro-batch, {rates.update_s * 1e3:.2f} ms per update",
                  f"disk writes {rates.disk_bytes_per_s / 1e6:,.0f} MB/s",
                  f"link between processes (FSDP2's collectives) "
                  f"{rates.link_bytes_per_s / 1e9:,.2f} GB/s, {rates.collective_s * 1e6:,.0f} us "
                  f"a collective: {rates.link_source}",
                  f"saved to {path}: `r1fit plan` reads it"], rich=sys.stdout.isatty())
    return 0
