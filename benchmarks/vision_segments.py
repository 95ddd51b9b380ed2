"""Vision attention in one call a layer (r1fit/models/vision_attention.py) against transformers'
per-segment sdpa loop: the seconds of a Qwen2.5-VL vision tower's forward over a step's images.

Command (CPU: the shipped Qwen2.5-VL-3B vision config at a width of 64 so that 2 cores run it in
about a second, 16 images of 448 x 448 px (16 windows of 8 x 8 patches each), 7 interleaved
repeats, about half a minute):

    python benchmarks/vision_segments.py
    # = --images 16 --image-px 448 --hidden 64 --heads 2 --intermediate 128
    #   --repeats 7 --device cpu --dtype float32 --min-speedup 1.05 --max-other-cpu 0.1 --retries 2
    python benchmarks/vision_segments.py --device cuda --dtype bfloat16 --hidden 0 --images 128
    #   on a GPU: the real width (--hidden 0 keeps the config's), a step's 128 images

What it shows: the loop makes one attention call per window (Qwen2.5-VL's 28 windowed layers) or
image (its 4 full-attention layers) from Python, ``28 x 256 + 4 x 16`` calls here; batched, one
a layer. At a width of 64 on a CPU the blocks' matrices still take most of the time, so the gain
is the loop's overhead alone; on a GPU, where the matrices take microseconds, that overhead is
most of a forward (not measured on a GPU yet).

How it measures: both settings run in this process on the same tower and inputs, alternating
(loop, batched, loop, ...), after one untimed forward of each; the table shows medians. A run
during which other processes used more than ``--max-other-cpu`` cores (/proc/stat minus this
process) is dropped and repeated, at most ``--retries`` times (then kept, and counted). Also
reported: attention calls per forward, and the largest difference of the outputs.

Target: median loop seconds / median batched seconds >= ``--min-speedup``. Exit status 0 when
met, 1 when missed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import benchkit
import torch

NAME = "vision_segments"
#: the shipped config whose vision tower is measured
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=benchkit.positive, default=16)
    p.add_argument("--image-px", type=benchkit.positive, default=448)
    p.add_argument("--hidden", type=int, default=64,
                   help="vision width (0: the config's own, 1,280)")
    p.add_argument("--heads", type=benchkit.positive, default=2)
    p.add_argument("--intermediate", type=benchkit.positive, default=128)
    p.add_argument("--repeats", type=benchkit.positive, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--min-speedup", type=float, default=1.05)
    p.add_argument("--max-other-cpu", type=float, default=0.1)
    p.add_argument("--retries", type=int, default=2)
    return p.parse_args(argv)


def tower(args: argparse.Namespace) -> torch.nn.Module:
    """A random-weight Qwen2.5-VL vision tower of the shipped 3B config (narrowed by --hidden)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from r1fit.models.builtin import shipped_config

    folder = shipped_config(MODEL)
    if folder is None:
        raise benchkit.BenchmarkError(f"r1fit ships no config.json for {MODEL}")
    shipped = json.loads((Path(folder) / "config.json").read_text())["vision_config"]
    if args.hidden:
        shipped.update(hidden_size=args.hidden, num_heads=args.heads,
                       intermediate_size=args.intermediate, out_hidden_size=args.hidden)
    config = Qwen2_5_VLVisionConfig(**shipped)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):  # drawn where it runs: 670M weights at the real width
        model = Qwen2_5_VisionTransformerPretrainedModel(config)
    return model.to(dtype=getattr(torch, args.dtype)).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    from transformers import AttentionInterface

    from r1fit.models.vision_attention import SEGMENT_ATTENTION, segment_attention

    model = tower(args)
    config = model.config
    side = args.image_px // config.patch_size
    grid = torch.tensor([[1, side, side]] * args.images, device=args.device)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(args.images * side * side, width, device=args.device,
                         dtype=getattr(torch, args.dtype))
    calls = {"sdpa": 0, SEGMENT_ATTENTION: 0}
    sdpa = AttentionInterface._global_mapping["sdpa"]

    def counted_sdpa(*a, **k):
        calls["sdpa"] += 1
        return sdpa(*a, **k)

    def counted_segments(*a, **k):
        calls[SEGMENT_ATTENTION] += 1
        return segment_attention(*a, **k)

    AttentionInterface.register("r1fit_bench_sdpa", counted_sdpa)
    AttentionInterface.register("r1fit_flash_layout_bench", counted_segments)
    names = {"sdpa": "r1fit_bench_sdpa", SEGMENT_ATTENTION: "r1fit_flash_layout_bench"}

    def forward(impl: str) -> torch.Tensor:
        config._attn_implementation = names[impl]
        with torch.no_grad():
            out = model(pixels, grid_thw=grid).pooler_output
        synchronize(args.device)
        return out

    outputs = {impl: forward(impl) for impl in names}  # untimed: warm-up, and the outputs
    per_forward = dict(calls)
    difference = float((outputs["sdpa"].float() - outputs[SEGMENT_ATTENTION].float()).abs().max())
    seconds: dict[str, list[float]] = {impl: [] for impl in names}
    disturbed = 0
    ticks = os.sysconf("SC_CLK_TCK")
    for _ in range(args.repeats):
        for impl in names:
            for attempt in range(args.retries + 1):
                before, start = benchkit.cpu_ticks(), time.perf_counter()
                forward(impl)
                took = time.perf_counter() - start
                others = benchkit.other_cores(before, benchkit.cpu_ticks(), took, ticks)
                if others is None or others <= args.max_other_cpu or attempt == args.retries:
                    disturbed += others is not None and others > args.max_other_cpu
                    seconds[impl].append(took)
                    break
    loop, batched = (statistics.median(seconds[impl]) for impl in names)
    speedup = loop / batched
    print(f"{'vision attention':24s} {'calls/forward':>14s} {'seconds (median)':>17s}")
    for impl, label in (("sdpa", "per segment (sdpa)"), (SEGMENT_ATTENTION, "one call a layer")):
        print(f"{label:24s} {per_forward[impl]:>14,d} {statistics.median(seconds[impl]):>17.3f}")
    print(f"{args.images} images of {args.image_px} px, width {config.hidden_size}, "
          f"{args.dtype} on {args.device}; {args.repeats} repeats, {disturbed} disturbed; "
          f"largest output difference {difference:.3g}")
    met = speedup >= args.min_speedup
    print(f"speedup {speedup:.2f}x (target >= {args.min_speedup:g}x): {'met' if met else 'MISSED'}")
    benchkit.print_result(NAME, {"calls": per_forward, "seconds": seconds, "speedup": speedup,
                                 "difference": difference, "disturbed": disturbed, "met": met})
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(benchkit.main(NAME, parse_args, run))
