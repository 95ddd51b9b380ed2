"""Checkpoint I/O: seconds to save a model folder, seconds and memory to load it back.

Command (about 75 s on 2 CPU cores; writes ~2.3 GB under $R1FIT_CACHE/bench, else
~/.cache/r1fit/bench, and removes it at the end unless --keep):

    python benchmarks/checkpoint_io.py
    # = --models builtin:small-realvocab random-1b --repeats 3 --min-gbps 1.0 --max-rss-ratio 1.2
    #   --config-dir /work/shared/model-configs/Qwen2.5-VL-3B-Instruct

Models:
- ``builtin:small-realvocab``: the built-in 81M-parameter Qwen2.5-VL (float32, 324 MB) and its
  processor;
- ``random-1b``: Qwen2.5-VL-3B's architecture (``--config-dir``) cut to 6 decoder layers and 10
  vision blocks, 1.01B parameters, bfloat16 (2.0 GB). Built on the ``meta`` device, materialised
  with ``to_empty`` and filled with ``normal_`` (random weights; no initialiser runs).

"full ckpt" columns: a training run's checkpoint of the same model (``CheckpointManager.save``:
weights + AdamW states in the parameters' dtype as torch.distributed.checkpoint shards, config and
processor files, RNG states, sha256 manifest, fsync); not under a target, reported so the cost of
a save is known.

Targets, for every model: load >= ``--min-gbps`` GB/s (checkpoint bytes / load seconds) and peak
RSS over the pre-load baseline <= ``--max-rss-ratio`` x the checkpoint's bytes. Exit status: 0
when every target is met, 1 when one is missed (the verdict lines say which), 2 on bad arguments
or a failed run.

How it measures:
- save (one child process per model, ``--repeats`` saves): the model folder as a checkpoint
  writes it, ``save_pretrained`` of the model (and processor) into a new folder, then fsync of
  every file and folder, so the time includes reaching the disk. The median is reported;
- load (a fresh child process per repeat): imports, the config and the model class are loaded
  first; then the baseline RSS is taken and the RSS high-water mark reset (Linux ``clear_refs``;
  peak = ``VmHWM`` of /proc/self/status, r1fit.memory.telemetry). Timed:
  ``AutoModelForImageTextToText.from_pretrained(folder, dtype=<saved dtype>, device_map="cpu")``
  (meta-device init + memory-mapped safetensors), then a sum over every parameter and buffer, so
  weights that are only mapped are really read and resident. One torch thread (see run_load);
- from the page cache: right before each load the parent reads every file of the folder once
  (the "cache read GB/s" column is that read's speed, the ceiling for a load);
- the load keeps the saved dtype: converting (e.g. float32 -> bfloat16) copies every tensor, so
  the mapped file and the copy would both count;
- the parent imports neither torch nor transformers, so the children's numbers are their own.

Mapped weights are private copy-on-write file pages: they count in RSS once read (``RssFile``),
and an optimizer step that writes a parameter turns its pages into anonymous memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchkit
from benchkit import BenchmarkError, positive, print_result, read_result, run_child

NAME = "checkpoint_io"
GB = 1e9
RANDOM_1B = "random-1b"
# Qwen2.5-VL-3B (36 decoder layers, 32 vision blocks, 3.75B) cut to ~1.0B parameters
RANDOM_1B_SHAPE = {"num_hidden_layers": 6, "vision_depth": 10}
DEFAULT_CONFIG_DIR = "/work/shared/model-configs/Qwen2.5-VL-3B-Instruct"


@dataclass
class Model:
    """One model's measurements (bytes and seconds)."""

    name: str
    params: int = 0
    dtype: str = ""
    checkpoint_bytes: int = 0
    save_seconds: list[float] = field(default_factory=list)
    full_checkpoint_bytes: int = 0  # model + AdamW states + RNG + manifest (a run's checkpoint)
    full_save_seconds: list[float] = field(default_factory=list)
    cache_read_seconds: list[float] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)  # one per repeat, from the child

    @property
    def save(self) -> float:
        return statistics.median(self.save_seconds)

    @property
    def load(self) -> float:
        return statistics.median(r["load_seconds"] for r in self.loads)

    @property
    def gbps(self) -> float:
        return self.checkpoint_bytes / GB / self.load

    @property
    def cache_gbps(self) -> float:
        return self.checkpoint_bytes / GB / statistics.median(self.cache_read_seconds)

    @property
    def peak_over_baseline(self) -> float:
        return statistics.median(r["peak_over_baseline"] for r in self.loads)

    @property
    def rss_ratio(self) -> float:
        return self.peak_over_baseline / self.checkpoint_bytes


# ----------------------------------------------------------------------------------------------
# children: build + save, load


def build_random_1b(config_dir: Path) -> Any:
    """Qwen2.5-VL-3B's architecture cut to ~1.0B parameters, random bfloat16 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    raw = json.loads((config_dir / "config.json").read_text())
    layers, depth = RANDOM_1B_SHAPE["num_hidden_layers"], RANDOM_1B_SHAPE["vision_depth"]
    # edit the JSON, not a built config: transformers derives layer_types from the layer count
    raw.update(num_hidden_layers=layers, max_window_layers=layers)
    vision = raw["vision_config"]
    vision["depth"] = depth
    vision["fullatt_block_indexes"] = [i for i in vision.get("fullatt_block_indexes", []) if i < depth]
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    # the rotary inv_freq buffers are left uninitialised: they are not saved, and nothing runs
    return model, None


def run_save(args: argparse.Namespace) -> int:
    """``--save MODEL``: build or load the model, save it ``--repeats`` times into ``--folder``
    (the last save stays), print the timings as the result line."""
    from r1fit.checkpoint.files import fsync_tree

    model, processor = (build_random_1b(Path(args.config_dir)) if args.save == RANDOM_1B
                        else load_builtin(args.save))
    folder = Path(args.folder)
    seconds = []
    for _ in range(args.repeats):
        if folder.exists():
            shutil.rmtree(folder)
        started = time.perf_counter()
        model.save_pretrained(folder)
        if processor is not None:
            processor.save_pretrained(folder)
        fsync_tree(folder)
        seconds.append(time.perf_counter() - started)
    full_bytes, full_seconds = full_checkpoint_save(model, processor, folder.parent / "full",
                                                    args.repeats)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    print_result(NAME, {"save_seconds": seconds,
                        "params": sum(p.numel() for p in model.parameters()),
                        "dtype": "/".join(dtypes), "checkpoint_bytes": folder_bytes(folder),
                        "full_checkpoint_bytes": full_bytes, "full_save_seconds": full_seconds})
    return 0


def full_checkpoint_save(model: Any, processor: Any, out: Path, repeats: int
                         ) -> tuple[int, list[float]]:
    """What a training run's save costs: ``CheckpointManager.save`` of the model folder plus the
    AdamW states (two per parameter, in the parameter's dtype), RNG states, the sha256 manifest and
    fsync, ``repeats`` times. Returns the checkpoint's bytes and the seconds of each save."""
    import torch

    from r1fit.checkpoint.manager import CheckpointManager
    from r1fit.checkpoint.state import OptimizerState
    from r1fit.config import load_config
    from r1fit.rng import RngState

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    state = {"optimizer": OptimizerState(model, optimizer), "rng": RngState()}
    state["optimizer"].state_dict()  # creates the AdamW states (exp_avg, exp_avg_sq) untimed
    cfg = load_config(None, [f"train.output_dir={out}", "checkpoint.every=1", "checkpoint.keep=1"])
    manager = CheckpointManager(out, cfg, "sft", resume=None)
    manager.add_model("model", model, processor)
    seconds = []
    for step in range(1, repeats + 1):
        started = time.perf_counter()
        path = manager.save("sft", step, state)
        seconds.append(time.perf_counter() - started)
    size = folder_bytes(path)
    shutil.rmtree(out)
    return size, seconds


def load_builtin(model: str) -> Any:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from r1fit.models.builtin import ensure_builtin

    if not model.startswith("builtin:"):
        raise BenchmarkError(f"--models: {model!r} is neither builtin:<name> nor {RANDOM_1B}")
    folder = ensure_builtin(model.split(":", 1)[1])
    return (AutoModelForImageTextToText.from_pretrained(folder, dtype="auto"),
            AutoProcessor.from_pretrained(folder))


def run_load(args: argparse.Namespace) -> int:
    """``--load FOLDER``: time from_pretrained + touching every weight, measure peak RSS over the
    baseline; print the result line."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText

    from r1fit.memory.telemetry import current_rss_bytes, peak_rss_bytes, reset_peak

    # one thread: the 2 cores are shared, and a 2-thread reduction stalls whenever another
    # process holds a core (touching small-realvocab: 0.02-0.04 s on one thread, 0.04-0.22 s on
    # two while something else ran); from_pretrained itself is single-threaded
    torch.set_num_threads(1)
    folder = Path(args.load)
    config = AutoConfig.from_pretrained(folder)
    getattr(transformers, config.architectures[0])  # import the modeling module before the baseline
    dtype = getattr(torch, args.dtype)
    baseline = current_rss_bytes()
    exact_peak = reset_peak(torch.device("cpu"))
    started = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, device_map="cpu")
    loaded = time.perf_counter()
    with torch.no_grad():
        total = sum(float(t.sum()) for t in (*model.parameters(), *model.buffers()))
    done = time.perf_counter()
    print_result(NAME, {"load_seconds": done - started,
                        "from_pretrained_seconds": loaded - started,
                        "touch_seconds": done - loaded, "baseline_rss": baseline,
                        "peak_over_baseline": peak_rss_bytes() - baseline,
                        "rss_after_over_baseline": current_rss_bytes() - baseline,
                        "peak_is_exact": exact_peak, "checksum": total})
    return 0


# ----------------------------------------------------------------------------------------------
# parent: children, table, targets


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def warm_page_cache(folder: Path) -> float:
    """Read every file of ``folder`` once (so the load reads from the page cache); seconds."""
    started = time.perf_counter()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - started


def bench_root() -> Path:
    # as r1fit.models.builtin.cache_root, which the parent does not import (it imports torch)
    env = os.environ.get("R1FIT_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "r1fit") / "bench"


def child(what: str, *mode: str) -> dict[str, Any]:
    """Run this script in a child mode; its result line."""
    stdout = run_child([sys.executable, os.path.abspath(__file__), *mode], what, NAME)
    return read_result(stdout, NAME, what)


def measure(args: argparse.Namespace, name: str, folder: Path) -> Model:
    """Save ``name`` into ``folder`` (one child), then load it ``--repeats`` times (a child
    each)."""
    result = Model(name)
    saved = child(f"saving {name}", "--save", name, "--folder", str(folder), "--repeats",
                  str(args.repeats), "--config-dir", args.config_dir)
    result.params, result.dtype = saved["params"], saved["dtype"]
    result.checkpoint_bytes, result.save_seconds = saved["checkpoint_bytes"], saved["save_seconds"]
    result.full_checkpoint_bytes = saved["full_checkpoint_bytes"]
    result.full_save_seconds = saved["full_save_seconds"]
    print(f"{name}: saved {result.checkpoint_bytes / GB:.2f} GB in {result.save:.2f} s",
          file=sys.stderr, flush=True)
    if "/" in result.dtype:
        raise BenchmarkError(f"{name} mixes dtypes ({result.dtype}); the load would convert some")
    for repeat in range(args.repeats):
        warm_page_cache(folder)  # the first read may come from the disk
        result.cache_read_seconds.append(warm_page_cache(folder))
        load = child(f"loading {name}", "--load", str(folder), "--dtype", result.dtype)
        result.loads.append(load)
        print(f"{name}: load {repeat + 1}/{args.repeats}: {load['load_seconds']:.2f} s, peak RSS "
              f"+{load['peak_over_baseline'] / GB:.2f} GB", file=sys.stderr, flush=True)
    return result


def print_table(models: list[Model]) -> None:
    """The results table (rich renders it; plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Checkpoint save and load (model folder; load from the page cache)")
    for name in ("model", "params", "dtype", "checkpoint GB", "save s", "full ckpt GB",
                 "full save s", "load s",
                 "from_pretrained s", "touch s", "load GB/s", "cache read GB/s",
                 "peak RSS over baseline GB", "x checkpoint"):
        table.add_column(name, justify="left" if name in ("model", "dtype") else "right",
                         no_wrap=name == "model")
    for m in models:
        table.add_row(m.name, f"{m.params / 1e9:.3f}B", m.dtype, f"{m.checkpoint_bytes / GB:.3f}",
                      f"{m.save:.2f}", f"{m.full_checkpoint_bytes / GB:.3f}",
                      f"{statistics.median(m.full_save_seconds):.2f}", f"{m.load:.3f}",
                      f"{statistics.median(r['from_pretrained_seconds'] for r in m.loads):.3f}",
                      f"{statistics.median(r['touch_seconds'] for r in m.loads):.3f}",
                      f"{m.gbps:.2f}", f"{m.cache_gbps:.2f}", f"{m.peak_over_baseline / GB:.3f}",
                      f"{m.rss_ratio:.3f}")
    Console(width=max(200, Console().width)).print(table)


def check_targets(models: list[Model], min_gbps: float, max_ratio: float) -> tuple[bool, list[str]]:
    """Every model: load GB/s >= min_gbps and peak RSS ratio <= max_ratio."""
    lines, met_all = [], True
    for m in models:
        met = m.gbps >= min_gbps and m.rss_ratio <= max_ratio
        met_all &= met
        lines.append(f"{m.name}: load {m.gbps:.2f} GB/s (target >= {min_gbps:.2f}), peak RSS "
                     f"{m.rss_ratio:.3f} x checkpoint (target <= {max_ratio:.2f}) -> "
                     f"{'met' if met else 'MISSED'}")
    return met_all, lines


def run_parent(args: argparse.Namespace) -> int:
    if RANDOM_1B in args.models and not (Path(args.config_dir) / "config.json").is_file():
        raise BenchmarkError(f"--config-dir {args.config_dir}: no config.json (a Qwen2.5-VL "
                             "config to build the random 1B model from)")
    root = bench_root() / "checkpoint_io"
    started = time.perf_counter()
    models = []
    try:
        for name in args.models:
            models.append(measure(args, name, root / name.replace("builtin:", "")))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(models)
    met, verdicts = check_targets(models, args.min_gbps, args.max_rss_ratio)
    print("\n".join(verdicts))
    print(f"median of {args.repeats} save(s) and {args.repeats} load(s) per model, each load in a "
          f"fresh process; folders under {root}{' (kept)' if args.keep else ' (removed)'}; "
          f"{time.perf_counter() - started:.0f} s in all. Times depend on other load on this "
          "machine.")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": sys.argv, "target_met": met, "verdicts": verdicts,
             "models": [asdict(m) | {"load_gbps": m.gbps, "rss_ratio": m.rss_ratio}
                        for m in models]}, indent=2))
    return 0 if met else 1


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin:small-realvocab", RANDOM_1B],
                   help=f"builtin:<name> (a built-in r1fit model) and/or {RANDOM_1B}")
    p.add_argument("--repeats", type=positive, default=3,
                   help="saves and loads per model; the table shows medians")
    p.add_argument("--config-dir", default=DEFAULT_CONFIG_DIR,
                   help=f"Qwen2.5-VL config.json folder that {RANDOM_1B} is cut down from")
    p.add_argument("--min-gbps", type=float, default=1.0,
                   help="target: checkpoint bytes / load seconds >= this (GB/s)")
    p.add_argument("--max-rss-ratio", type=float, default=1.2,
                   help="target: peak RSS over the pre-load baseline <= this x checkpoint bytes")
    p.add_argument("--keep", action="store_true", help="keep the saved folders")
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers here")
    p.add_argument("--save", metavar="MODEL", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--folder", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--load", metavar="FOLDER", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--dtype", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    bad = [m for m in args.models if m != RANDOM_1B and not m.startswith("builtin:")]
    if bad:
        p.error(f"--models: {bad[0]!r} is neither builtin:<name> nor {RANDOM_1B}")
    if args.min_gbps <= 0 or args.max_rss_ratio <= 0:
        p.error("--min-gbps and --max-rss-ratio must be > 0")
    return args


def run(args: argparse.Namespace) -> int:
    """The child mode the arguments name, else the parent."""
    if args.save:
        return run_save(args)
    if args.load:
        return run_load(args)
    return run_parent(args)


def main(argv: Sequence[str] | None = None) -> int:
    return benchkit.main(NAME, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
