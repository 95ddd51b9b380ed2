"""LoRA's adapters in float32 (peft's own path) against the model's dtype under autocast
(``model.lora.compute_dtype=model``): the seconds of one training micro-batch's forward and
backward through r1fit's log-prob root, on a 16-bit model.

Command (CPU: builtin:bench-3b-cut, Qwen2.5-VL-3B's widths cut to 4 decoder layers, in bfloat16,
LoRA r=64 on every linear layer as the shipped recipe has it, 2 rows of 128 + 128 tokens,
gradient checkpointing on, 5 interleaved repeats; about a minute):

    python benchmarks/adapter_compute.py
    # = builtin:bench-3b-cut --rows 2 --prompt-tokens 128 --completion-tokens 128 --lora-r 64
    #   --lora-alpha 128 --repeats 5 --device cpu --min-speedup 0
    python benchmarks/adapter_compute.py MODEL_DIR --device cuda --rows 8 --prompt-tokens 446 \
        --completion-tokens 512 --min-speedup 1.0
    #   on a GPU (benchmarks/gpu_check.py's speed stage): the 3B model at the speed step's
    #   micro-batch (8 rows of a 446-token prompt and 512 completion tokens)

What it shows: with peft's float32 adapters each adapted Linear of a 16-bit model casts its
input to float32, multiplies in float32 and adds in float32 (r1fit/memory/planner/timing.py's
CAST_*_BYTES count the bytes); under autocast the products run in the model's dtype from the
same float32 weights, whose gradients stay float32. On a GPU, whose float32 products run
without tensor cores by default, that is where the time model puts 5.6 s of the 3B recipe's 13.0 s
update (not measured on a GPU yet). On a CPU, whose bfloat16 products can be slower than its
float32 ones, the target is not judged (``--min-speedup 0``).

How it measures: both settings run in this process on the same model and rows, alternating
(float32, model, float32, ...), after one untimed pass of each; medians. A pass during which
other processes used more than ``--max-other-cpu`` cores is repeated, at most ``--retries``
times (then kept, and counted). Also reported: each setting's peak memory over the model (CUDA),
the largest log-prob difference and the cosine of the adapters' gradients between them.

Target: median float32 seconds / median model-dtype seconds >= ``--min-speedup``. Exit status 0
when met, 1 when missed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import benchkit
import torch

NAME = "adapter_compute"
SETTINGS = ("float32", "model")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="builtin:bench-3b-cut",
                   help="a model folder or built-in name (a 16-bit model is loaded as --dtype)")
    p.add_argument("--rows", type=benchkit.positive, default=2)
    p.add_argument("--prompt-tokens", type=benchkit.positive, default=128)
    p.add_argument("--completion-tokens", type=benchkit.positive, default=128)
    p.add_argument("--lora-r", type=benchkit.positive, default=64)
    p.add_argument("--lora-alpha", type=benchkit.positive, default=128)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=benchkit.positive, default=5)
    p.add_argument("--min-speedup", type=float, default=0.0)
    p.add_argument("--max-other-cpu", type=float, default=0.1)
    p.add_argument("--retries", type=int, default=2)
    return p.parse_args(argv)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    from r1fit.config import load_config
    from r1fit.data.batch import Batch
    from r1fit.distributed.loading import load_policy_on_ranks
    from r1fit.models.logprobs import adapter_backward, completion_logprobs_and_entropy

    cfg = load_config(None, [f"model.path={args.model}", f"model.dtype={args.dtype}",
                             f"model.lora.r={args.lora_r}", f"model.lora.alpha={args.lora_alpha}",
                             "model.lora.compute_dtype=model"])
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, _, root = load_policy_on_ranks(cfg.model, device, activation_checkpointing=True)
    dtype = root.adapter_dtype  # the 16-bit --dtype: LoRA's adapters under autocast
    assert dtype is not None
    for name, p in model.named_parameters():  # lora_B starts at 0: the adapters would add 0
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    width = args.prompt_tokens + args.completion_tokens
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(10, min(vocab, 30_000), (args.rows, width), device=device)
    mask = torch.ones_like(ids)
    completion = ids[:, args.prompt_tokens:]
    batch = Batch({"input_ids": ids, "attention_mask": mask}, args.prompt_tokens, completion,
                  torch.ones(completion.shape, device=device))
    advantages = torch.linspace(-1, 1, args.rows, device=device).unsqueeze(1)
    cuda = device.type == "cuda"

    def one(setting: str) -> tuple[float, torch.Tensor, torch.Tensor, int]:
        """A forward and backward: (seconds, log-probs, adapters' gradients, peak bytes)."""
        root.adapter_dtype = dtype if setting == "model" else None
        model.zero_grad(set_to_none=True)
        synchronize(args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        logp, _ = completion_logprobs_and_entropy(root, batch, chunk_size=1024)
        with adapter_backward(root):
            (-(logp * advantages).sum() / logp.numel()).backward()
        synchronize(args.device)
        took = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - before if cuda else 0
        return took, logp.detach(), torch.cat([p.grad.flatten() for p in adapters]), peak

    first = {s: one(s) for s in SETTINGS}  # untimed: warm-up, and what each computes
    difference = float((first["float32"][1] - first["model"][1]).abs().max())
    cosine = float(torch.nn.functional.cosine_similarity(first["float32"][2].double(),
                                                         first["model"][2].double(), dim=0))
    seconds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    peaks = {s: first[s][3] for s in SETTINGS}
    disturbed = 0
    ticks = os.sysconf("SC_CLK_TCK")
    for _ in range(args.repeats):
        for setting in SETTINGS:
            for attempt in range(args.retries + 1):
                before = benchkit.cpu_ticks()
                took, _, _, peak = one(setting)
                others = benchkit.other_cores(before, benchkit.cpu_ticks(), took, ticks)
                if others is None or others <= args.max_other_cpu or attempt == args.retries:
                    disturbed += others is not None and others > args.max_other_cpu
                    seconds[setting].append(took)
                    peaks[setting] = max(peaks[setting], peak)
                    break
    median = {s: statistics.median(seconds[s]) for s in SETTINGS}
    speedup = median["float32"] / median["model"]
    tokens = args.rows * width
    print(f"{'adapters compute in':28s} {'seconds (median)':>17s} {'tokens/s':>10s} "
          f"{'peak over the model':>20s}")
    for setting, label in (("float32", "float32 (peft's own)"),
                           ("model", f"{str(dtype).removeprefix('torch.')} (autocast)")):
        print(f"{label:28s} {median[setting]:>17.3f} {tokens / median[setting]:>10,.0f} "
              f"{(f'{peaks[setting] / 2**20:,.0f} MiB' if cuda else '-'):>20s}")
    print(f"{args.model} in {args.dtype}, LoRA r={args.lora_r} on every linear layer, "
          f"{args.rows} rows x ({args.prompt_tokens} + {args.completion_tokens}) tokens, "
          f"checkpointing on, {args.device}; {args.repeats} repeats, {disturbed} disturbed; "
          f"log-probs differ by up to {difference:.3g}, gradients' cosine {cosine:.4f}")
    met = speedup >= args.min_speedup
    print(f"speedup {speedup:.2f}x (target >= {args.min_speedup:g}x): "
          f"{'met' if met else 'MISSED'}")
    benchkit.print_result(NAME, {"seconds": seconds, "speedup": speedup, "peak_bytes": peaks,
                                 "difference": difference, "cosine": cosine,
                                 "disturbed": disturbed, "tokens": tokens, "met": met})
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(benchkit.main(NAME, parse_args, run))
