"""``r1fit train | sft | eval | plan | config | inspect | export | report``: parse, build, run.

    r1fit train                      # the built-in demo (tiny model, builtin:shapes)
    r1fit train my.yaml algo.num_generations=8 model.lora.r=16
    r1fit sft my.yaml sft.steps=500
    r1fit eval my.yaml --model runs/demo/final   # data.eval scored: accuracy, pass@k, eval.html
    r1fit plan my.yaml --device-memory 80GiB  # peak memory per device, before launch (no weights)
    r1fit plan Qwen/Qwen2.5-VL-7B-Instruct    # a model instead of a config: model.path=...
    r1fit plan my.yaml --sft                  # a step of r1fit sft instead of a GRPO step
    r1fit config [my.yaml ...]       # each key's value and where it came from; --json; --reference
    r1fit inspect runs/demo          # its checkpoints, newest first; or one checkpoint's files
    r1fit export runs/demo/checkpoint-40 my-model [--merge-lora]   # a plain Hugging Face folder
    r1fit report runs/demo [--out FILE]   # one HTML file: plots, alarms, sampled rollouts
    r1fit doctor [--json] [--check] [--calibrate]  # facts for a bug report; self-check; rates
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from r1fit.config import Config, ConfigError, config_reference_markdown, resolve_config
from r1fit.errors import R1fitError, one_line


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional config file comes first; everything with '=' is an override."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _model_first(args: list[str]) -> list[str]:
    """``r1fit plan MODEL ...``: a first argument that is no file and no YAML name is a model
    folder or hub id, i.e. ``model.path=MODEL`` over the defaults."""
    path, overrides = _split_args(args)
    if path is None or Path(path).is_file() or path.endswith((".yaml", ".yml")):
        return args
    return [f"model.path={path}", *overrides]


def _config(args: list[str]) -> Config:
    return _resolved(args)[0]


def _resolved(args: list[str]) -> tuple[Config, dict[str, str]]:
    """The config of ``CONFIG.yaml key=value ...`` and each key's source (see resolve_config)."""
    path, overrides = _split_args(args)
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path} (overrides look like key.sub=value)")
    return resolve_config(path, overrides)


#: longest value `r1fit config` shows in full (a system prompt is cut; --json has it whole)
SHOWN_VALUE = 60


def print_sources(cfg: Config, sources: dict[str, str]) -> None:
    """``r1fit config``: one line per key, its value and where it came from."""
    values = {}
    for key in sources:
        value = cfg.value(key)
        shown = json.dumps(list(value) if isinstance(value, tuple) else value)
        values[key] = shown if len(shown) <= SHOWN_VALUE else shown[:SHOWN_VALUE - 3] + "..."
    preset = cfg.applied_preset()
    why = (" (model.path is a built-in random-weight model)" if cfg.preset == "auto" else "") \
        if preset else ""
    print(f"# preset: {preset or 'none'}{why}; sources: default, preset, file, override")
    width = max(map(len, sources))
    value_width = max(map(len, values.values()))
    for key, source in sources.items():
        print(f"{key:<{width}}  {values[key]:<{value_width}}  {source}")


def _run(command: str, cfg: Config) -> None:
    from r1fit.processes import DistributedError, close_distributed, lost_peer, world

    finished = False
    try:
        if command == "train":
            from r1fit.train.grpo import train_grpo

            train_grpo(cfg)
        else:
            from r1fit.train.sft import train_sft

            train_sft(cfg)
        finished = True
    except Exception as exc:
        if world().distributed and not isinstance(exc, R1fitError) and lost_peer(exc):
            # the process that failed says why; this one only lost it (a raw gloo traceback)
            raise DistributedError(
                f"rank {world().rank} lost another process of the run, which stopped (its own "
                f"error is above; {exc.__class__.__name__}: {one_line(exc, 160, first_line=True)}"
                "); rerun the same command to resume from the last checkpoint") from exc
        raise
    finally:
        helper_rank = world().distributed and not world().main
        close_distributed(barrier=finished)
    if finished and helper_rank:
        _leave_without_finalizing()


def _leave_without_finalizing() -> None:
    """End a torchrun process other than rank 0 whose run finished everywhere, once its process
    group is destroyed, without the interpreter's finalization: there, gloo's threads still
    holding tensors have aborted a process now and then ("terminate called without an active
    exception", SIGABRT), and torchrun then reported a finished run as FAILED (seen twice in the
    e2e suite on CPU, never reproduced at will; PyTorch discusses it in pytorch/pytorch#179291).
    Such a rank has nothing left to write: its checkpoint shards were saved and fsynced, its log
    goes to the terminal, trackers and reports are rank 0's; its streams are flushed first."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: GRPO keys ``r1fit sft`` does not read, and the SFT key it reads instead
SFT_READS_INSTEAD = {"train.max_steps": "sft.steps", "train.learning_rate": "sft.learning_rate"}


def cmd_train(ns: argparse.Namespace) -> int:
    """``r1fit train`` (SFT format warm-up, then GRPO) and ``r1fit sft``: run as configured."""
    cfg, sources = _resolved(ns.args)
    if ns.command == "sft":  # an override on the command line that this command would drop
        for key, instead in SFT_READS_INSTEAD.items():
            if sources.get(key) == "override":
                print(f"r1fit: warning: {key}={cfg.value(key)} has no effect on r1fit sft, which "
                      f"reads {instead} (now {cfg.value(instead)})", file=sys.stderr)
    from r1fit.memory.telemetry import configure_cuda_allocator

    configure_cuda_allocator()  # before anything touches CUDA
    # the run catches SIGTERM/SIGUSR1 to save before stopping; give them back afterwards
    stop_signals = [sig for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if sig]
    handlers = {sig: signal.getsignal(sig) for sig in stop_signals}
    try:
        _run(ns.command, cfg)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    """``r1fit eval``: a model, checkpoint or LoRA adapter scored on ``data.eval``."""
    cfg = _config(ns.args)
    from r1fit.memory.telemetry import configure_cuda_allocator
    from r1fit.report.blocks import print_blocks
    from r1fit.report.eval_page import summary_lines
    from r1fit.train.eval_command import evaluate_model

    configure_cuda_allocator()  # before anything touches CUDA
    summary, out = evaluate_model(cfg, ns.model, ns.out)
    if ns.json:
        print(json.dumps(summary, indent=2))
        return 0
    how = "greedy" if summary["samples"] == 1 else f"{summary['samples']} samples per row"
    print_blocks([f"r1fit eval: {summary['model']} ({summary['model_kind']}) on "
                  f"{summary['data']}, {how}",
                  (["metric", "value"], summary_lines(summary), {1}),
                  f"eval.jsonl, eval.html and summary.json in {out}"],
                 rich=sys.stdout.isatty())
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    """``r1fit plan``: the memory plan of a run, before launching it."""
    from r1fit.memory.planner import plan_memory, render
    from r1fit.units import parse_bytes, parse_memory

    try:
        budget = parse_memory(ns.device_memory) if ns.device_memory else None
    except ValueError as exc:
        raise ConfigError(f"--device-memory: {exc}") from None
    cfg = _config(_model_first(ns.args))
    device_type = "cpu" if cfg.train.device == "cpu" else "cuda"
    elsewhere = False  # planning a CUDA device on a machine without one: said after the plan
    if budget is None and not cfg.memory.budget and device_type == "cuda":
        budget = this_gpus_free_memory(cfg.train.device)
        elsewhere = budget is None
    kind = "sft" if ns.sft else "grpo"
    if cfg.memory.gradient_checkpointing == "auto":  # plan what the run would choose
        from r1fit.memory.autofit import choose_checkpointing, describe_checkpointing
        from r1fit.memory.planner import DEFAULT_DEVICE_MEMORY

        chosen, why = choose_checkpointing(
            cfg, budget=budget or parse_bytes(cfg.memory.budget or DEFAULT_DEVICE_MEMORY),
            device_type=device_type, gpus=ns.gpus, kind=kind)
        print(f"memory.gradient_checkpointing=auto: {describe_checkpointing(chosen)} "
              f"({why})", file=sys.stderr)
        cfg = cfg.with_values(chosen)
    plan = plan_memory(cfg, device_memory_bytes=budget, gpus=ns.gpus,
                       device_type=device_type, kind=kind, faster=True, turns=ns.turns)
    if ns.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        render(plan, cfg, rich=sys.stdout.isatty())
    if elsewhere:
        print("r1fit plan: planned for a CUDA device (this machine has none; train.device=cpu "
              "plans a run on this CPU)", file=sys.stderr)
    return 0


def this_gpus_free_memory(name: str) -> int | None:
    """On a machine with CUDA, the free memory of the GPU ``train.device`` names ('auto' and
    'cuda': the first), which a run's ``auto`` sizes take at start-up (said on stderr); None
    without CUDA."""
    import torch

    from r1fit.units import format_bytes

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda" if name == "auto" else name)
    index = device.index or 0
    free, total = torch.cuda.mem_get_info(index)
    print(f"r1fit plan: for the free memory of this machine's {torch.cuda.get_device_name(index)} "
          f"(cuda:{index}): {format_bytes(free)} of {format_bytes(total)}, as a run's auto sizes "
          f"take it (--device-memory plans another)", file=sys.stderr)
    return int(free)  # what memory.budget's absence gives a run (r1fit.memory.autofit)


def cmd_config(ns: argparse.Namespace) -> int:
    """``r1fit config``: each key's value and source, the resolved config as JSON, or the key
    reference."""
    if ns.reference:
        if ns.args:  # the reference is every key's default and meaning, of no config
            raise ConfigError(f"r1fit config --reference takes no config or overrides (got "
                              f"{' '.join(ns.args)}); r1fit config {' '.join(ns.args)} shows "
                              "their values")
        print(config_reference_markdown())
    elif ns.json:
        print(json.dumps(_config(ns.args).to_dict(), indent=2))
    else:
        print_sources(*_resolved(ns.args))
    return 0


def cmd_inspect(ns: argparse.Namespace) -> int:
    """``r1fit inspect``: what a checkpoint, run folder or model folder holds."""
    from r1fit.checkpoint.inspect import inspect_path, render

    report = inspect_path(ns.path)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, rich=sys.stdout.isatty())
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    """``r1fit export``: a checkpoint's model as a plain Hugging Face folder."""
    from r1fit.checkpoint.export import export

    print(export(ns.checkpoint, ns.out, merge_lora=ns.merge_lora).summary(ns.checkpoint))
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    """``r1fit report``: a run's HTML report."""
    from r1fit.report.html import write_report

    out = ns.out
    if out is not None:  # a trailing / names a folder, made if new (Path drops the slash)
        out = Path(out) / "report.html" if out.endswith(("/", os.sep)) else Path(out)
    print(write_report(ns.run_dir, out))
    return 0


def cmd_doctor(ns: argparse.Namespace) -> int:
    """``r1fit doctor``: the machine's facts; with ``--check`` a self-check."""
    from r1fit.doctor.command import doctor

    if ns.out is not None and not ns.check:
        raise ConfigError("r1fit doctor: --out is where --check writes its run; without --check "
                          "nothing is written")
    return doctor(json_out=ns.json, check=ns.check, out=ns.out, calibrate=ns.calibrate)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train, "sft": cmd_train, "eval": cmd_eval, "plan": cmd_plan,
    "config": cmd_config,
    "inspect": cmd_inspect, "export": cmd_export, "report": cmd_report, "doctor": cmd_doctor,
}


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per key of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="r1fit", description="GRPO and SFT for vision-language models.",
        epilog="Every config key, its default and meaning: r1fit config --reference")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "SFT format warm-up, then GRPO (no arguments: the demo)"),
                       ("sft", "supervised fine-tuning on the solutions")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.sub=value")
    text = ("score a model on data.eval with the config's rewards: accuracy, format, pass@k and "
            "mean@k (eval.samples=k; greedy when 1), eval.jsonl, eval.html, summary.json")
    p = sub.add_parser("eval", help=text, description=text)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.sub=value",
                   help="the run's config and overrides (no config: the demo's)")
    p.add_argument("--model", metavar="PATH",
                   help="what to score (default: model.path): a model folder or hub id (a full "
                        "fine-tuning run's final/), a LoRA adapter folder (a LoRA run's final/; "
                        "loaded onto model.path), or a run's checkpoint-N folder (its weights on "
                        "the base and LoRA settings it recorded)")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="a new or empty folder for the outputs (default: "
                        "<train.output_dir>/eval/<model>-<date>-<time>)")
    p.add_argument("--json", action="store_true", help="print summary.json instead of a table")
    text = "predict a run's peak memory per device before launching it (reads no weights)"
    p = sub.add_parser("plan", help=text, description=text)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | MODEL | key.sub=value",
                   help="a config file, or a model (folder or hub id, e.g. "
                        "Qwen/Qwen2.5-VL-7B-Instruct) planned with the default config; then "
                        "overrides")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory of one device, e.g. 80GiB (default: memory.budget, else the "
                        "free memory of this machine's GPU, else 80GiB)")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="GPUs of the torchrun job; with N > 1 the plan is per GPU with FSDP2 "
                        "over N (sharded weights, gradients, AdamW states and reference; 1/N of "
                        "a step's rows per GPU)")
    p.add_argument("--sft", action="store_true",
                   help="plan a step of `r1fit sft` (sft.batch_size rows, answers of "
                        "sft.max_answer_tokens tokens) instead of a GRPO step of `r1fit train`")
    p.add_argument("--turns", type=float, metavar="T",
                   help="with tools: time the trajectories at this mean of policy turns (a "
                        "run's turns_mean) instead of rollout.max_turns, the most they may take")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    text = ("print each key's value and where it came from (default, preset, file, override), "
            "or the key reference")
    p = sub.add_parser("config", help=text, description=text)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.sub=value")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--reference", action="store_true",
                       help="print every key with its help text")
    shown.add_argument("--json", action="store_true",
                       help="print the resolved config as JSON (as the run's config.json "
                            "records it)")
    text = "what a checkpoint, a run's output folder or a model folder holds; can a run resume"
    p = sub.add_parser("inspect", help=text, description=text)
    p.add_argument("path", metavar="PATH", type=Path)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    text = "write a checkpoint's model as a plain Hugging Face folder (from_pretrained loads it)"
    p = sub.add_parser("export", help=text, description=text)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=Path)
    p.add_argument("out", metavar="OUT", type=Path, help="a new (or empty) folder")
    p.add_argument("--merge-lora", action="store_true",
                   help="merge a LoRA adapter into the run's base model: a standalone model")
    text = "write a run's report: one HTML file (plots, alarms, sampled rollouts) that opens from disk"
    p = sub.add_parser("report", help=text, description=text)
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run's output folder")
    p.add_argument("--out", metavar="FILE",
                   help="where to write it: a file, or a folder to write report.html into (one "
                        "that exists, or a path ending in /) (default: RUN_DIR/report.html)")
    text = "versions, GPUs, attention kernels, TF32, peak FLOP/s, CPU: the facts for a bug report"
    p = sub.add_parser("doctor", help=text, description=text)
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    task = p.add_mutually_exclusive_group()
    task.add_argument("--check", action="store_true",
                      help="also run a self-check of about a minute on the first device (memory "
                           "plan vs measured, shared-prompt/prefill numerics, kill and resume); "
                           "exit status 1 when an item fails")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="--check: where its runs go, a new or empty folder (default: a "
                        "temporary folder, removed afterwards)")
    task.add_argument("--calibrate", action="store_true",
                      help="measure the first device's rates for the time model (matmul FLOP/s, "
                           "copy bandwidth, launch cost, a decoder layer's step, disk writes; "
                           "under a minute) and cache them for `r1fit plan`")
    return parser


#: OS errors that say what is wrong with the machine (a full disk or quota, a read-only file
#: system, a permission): one line naming the file, as for any cause the user can fix
MACHINE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # overrides after a flag (`r1fit plan my.yaml --sft sft.batch_size=8`): argparse ends a
    # positional list at the first flag, so the rest comes back unparsed
    if extra and hasattr(ns, "args") and not any(e.startswith("-") for e in extra):
        ns.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    command = COMMANDS[ns.command]
    # imported late: `r1fit config` and `--help` should not pay for importing torch/transformers,
    # nor `r1fit doctor` for peft and transformers (seconds): it stops no run
    stopped: type[BaseException] | tuple[()] = ()
    if ns.command in ("train", "sft"):  # the others stop no run (and this import costs seconds)
        from r1fit.checkpoint.manager import RunStopped as stopped

    try:
        return command(ns)
    except R1fitError as exc:  # a cause the user can fix: one line, no traceback
        print(f"r1fit: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `r1fit config | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would fail again
        return 1
    except OSError as exc:
        if exc.errno not in MACHINE_ERRNOS:
            raise
        # the machine's, not r1fit's: a full disk, a read-only folder, no permission
        where = f"{exc.filename}: " if exc.filename else ""
        # a write that names no file: say what was going on
        doing = "" if exc.filename or ns.command not in ("train", "sft") else (
            " (while writing the run's files; a run resumes from its last complete checkpoint "
            "once there is room)")
        print(f"r1fit: error: {where}{exc.strerror or exc}{doing}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("r1fit: interrupted", file=sys.stderr)
        return 130
    except stopped as exc:  # SIGTERM/SIGUSR1 (pre-emption) after saving a checkpoint
        print(f"r1fit: {exc}", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
