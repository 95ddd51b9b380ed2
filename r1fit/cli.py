"""``r1fit train | sft | config``: parse, build, run.

    r1fit train                      # the built-in demo (tiny model, builtin:shapes)
    r1fit train my.yaml algo.num_generations=8 model.lora.r=16
    r1fit sft my.yaml sft.steps=500
    r1fit config [my.yaml ...]       # print the resolved config; --reference for every key
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from r1fit.config import Config, ConfigError, config_reference_markdown, load_config


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional config file comes first; everything with '=' is an override."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _config(args: list[str]) -> Config:
    path, overrides = _split_args(args)
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path} (overrides look like key.sub=value)")
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="r1fit", description="GRPO and SFT for vision-language models.",
        epilog="Every config key, its default and meaning: r1fit config --reference")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "SFT format warm-up, then GRPO (no arguments: the demo)"),
                       ("sft", "supervised fine-tuning on the solutions")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.sub=value")
    p = sub.add_parser("config", help="print the resolved config (or the key reference)")
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.sub=value")
    p.add_argument("--reference", action="store_true", help="print every key with its help text")
    ns = parser.parse_args(argv)

    # imported late: `r1fit config` and `--help` should not pay for importing torch/transformers
    from r1fit.checkpoint.manager import CheckpointError
    from r1fit.data.dataset import DataError
    from r1fit.models.load import ModelConfigError
    from r1fit.rewards.registry import RewardConfigError
    from r1fit.train.common import RunError

    known = (CheckpointError, ConfigError, DataError, ModelConfigError, RewardConfigError, RunError)
    try:
        if ns.command == "config":
            if ns.reference:
                print(config_reference_markdown())
            else:
                print(json.dumps(_config(ns.args).to_dict(), indent=2))
            return 0
        cfg = _config(ns.args)
        if ns.command == "train":
            from r1fit.train.grpo import train_grpo

            train_grpo(cfg)
        else:
            from r1fit.train.sft import train_sft

            train_sft(cfg)
        return 0
    except known as exc:
        print(f"r1fit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("r1fit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
