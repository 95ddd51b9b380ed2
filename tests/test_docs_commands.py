"""Every command the manual shows in a fenced block runs when pasted, as far as a CPU can tell.

The commands are the lines of README.md's and docs/'s fenced blocks (untyped, bash, sh, shell,
console; in a block that uses `$ ` prompts only those lines) that start with `r1fit ` or
`torchrun ... -m r1fit `, after joining `\\` continuations and splitting at `&&`, `||`, `;`
and `|`. Each is parsed by the CLI's own argparse parser. A `train`, `sft`, `eval`, `plan` or
`config` command is then resolved by `r1fit config --json`, so every key exists and every value is
valid. The files it names must be there:

- `model.path` and, for `train` and `sft`, `data.train`, `data.eval`, `data.image_folder` and
  `data.eval_image_folder` (for `eval`: `data.eval`, `data.eval_image_folder` and `--model`): a
  `builtin:` name, a hub id (`owner/name`, `@split` allowed, no file
  suffix), a path under the documented placeholder `/data/`, a file or folder of this
  repository, or a path under an output folder (`train.output_dir`, `r1fit export`'s OUT) of a
  command earlier on the same page;
- the paths `inspect`, `export` and `report` read: the same rule;
- a hub model is not trained on the built-in task (a command that forgot its config).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from r1fit.cli import _model_first, build_parser, main
from r1fit.units import parse_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_docs import ROOT, manual_pages  # noqa: E402

SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
CONFIG_COMMANDS = ("train", "sft", "eval", "plan", "config")
PLACEHOLDER = "/data/"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w.-]+)?")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".yaml", ".yml")
#: a line that starts a command r1fit runs (other lines of an untyped block may be prose)
COMMAND_START = re.compile(r"(^|&&|\|\||;|\|)\s*([A-Z_][A-Z0-9_]*=\S*\s+)*(r1fit|torchrun)\s")
#: the default train.output_dir: what a bare `r1fit train` writes
DEMO_OUTPUT = "runs/demo"


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(m.group(1).strip(), m.group(2))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)]


def commands_in(text: str) -> list[list[str]]:
    """The r1fit commands of a page's shell blocks, each as its argument list after `r1fit`."""
    found = []
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_BLOCKS:
            continue
        lines = re.sub(r"\\\n", " ", body).splitlines()
        if any(line.startswith("$ ") for line in lines):
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        for line in filter(COMMAND_START.search, lines):
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words, command = list(lexer), []
            for word in [*words, ";"]:
                if word in ("&&", "||", ";", "|"):
                    args = r1fit_args(command)
                    if args is not None:
                        found.append(args)
                    command = []
                else:
                    command.append(word)
    return found


def r1fit_args(words: list[str]) -> list[str] | None:
    """The arguments after `r1fit` (or `torchrun ... -m r1fit`), or None for another command."""
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:1] == ["r1fit"]:
        return words[1:]
    if words[:1] == ["torchrun"] and "-m" in words:
        at = words.index("-m")
        if words[at + 1:at + 2] == ["r1fit"]:
            return words[at + 2:]
    return None


def path_problem(key: str, value: str, produced: list[str]) -> str | None:
    """Why a path the manual names would not be there when pasted, or None."""
    if value.startswith(PLACEHOLDER) or (not value.startswith("/") and (ROOT / value).exists()):
        return None
    if any(value == out or value.startswith(out.rstrip("/") + "/") for out in produced):
        return None
    return f"{key}={value}: not in the repository, not under {PLACEHOLDER}, not an earlier output"


def source_problem(key: str, value: str | None, produced: list[str]) -> str | None:
    """As path_problem, for values that may also be a built-in or a hub id."""
    if value is None or value.startswith("builtin:"):
        return None
    if HUB_ID.fullmatch(value) and not value.endswith(FILE_SUFFIXES):
        return None
    return path_problem(key, value, produced)


def as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_command(args: list[str], produced: list[str]) -> list[str]:
    """What is wrong with `r1fit ARGS` as a pasted command (nothing: []). Appends the folders the
    command writes to ``produced``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns, extra = build_parser().parse_known_args(args)
    except SystemExit:
        return [f"does not parse: {err.getvalue().strip().splitlines()[-1]}"]
    if extra and not (hasattr(ns, "args") and not any(e.startswith("-") for e in extra)):
        return [f"unrecognized arguments: {' '.join(extra)}"]
    if ns.command not in CONFIG_COMMANDS:
        problems = [path_problem(attr, str(getattr(ns, attr)), produced)
                    for attr in ("path", "run_dir", "checkpoint") if hasattr(ns, attr)]
        if ns.command == "export":
            produced.append(str(ns.out))
        return [p for p in problems if p]
    config_args = [*ns.args, *extra]
    if ns.command == "plan":
        config_args = _model_first(config_args)
        try:
            parse_bytes(ns.device_memory or "80GiB")
        except ValueError as exc:
            return [f"--device-memory: {exc}"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["config", "--json", *config_args])
    if status != 0:
        return [err.getvalue().strip()]
    cfg = json.loads(out.getvalue())
    problems = [source_problem("model.path", cfg["model"]["path"], produced)]
    if ns.command in ("train", "sft"):  # plan and config read no data
        problems += data_problems(cfg, produced)
        produced.append(cfg["train"]["output_dir"])
    if ns.command == "eval":  # data.eval only, and the model it scores
        problems += data_problems(cfg, produced, keys=("eval",))
        problems.append(source_problem("--model", getattr(ns, "model", None), produced))
    return [p for p in problems if p]


def data_problems(cfg: dict, produced: list[str], keys: tuple[str, ...] = ("train", "eval")
                  ) -> list[str | None]:
    """check_command's rules for the data a resolved config (``r1fit config --json``) reads."""
    data = cfg["data"]
    folders = {"train": "image_folder", "eval": "eval_image_folder"}
    problems = [source_problem(f"data.{key}", value, produced)
                for key in keys for value in as_list(data[key])]
    problems += [path_problem(f"data.{folders[key]}", value, produced)
                 for key in keys for value in as_list(data[folders[key]]) if value is not None]
    model = cfg["model"]["path"]
    if HUB_ID.fullmatch(model) and any(str(v).startswith("builtin:") for v in as_list(data["train"])):
        problems.append(f"model.path={model} on data.train={data['train']}: a hub model on the "
                        "built-in task (name a config and data)")
    return problems


def manual_commands() -> list[tuple[str, list[str]]]:
    return [(page.relative_to(ROOT).as_posix(), args)
            for page in manual_pages() for args in commands_in(page.read_text())]


@pytest.fixture
def at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # relative paths in the manual are from the repository root


def test_every_command_in_the_manual_runs_when_pasted(at_root):
    commands = manual_commands()
    pages = {page for page, _ in commands}
    assert {"README.md", "docs/training.md", "docs/distributed.md", "docs/vllm.md"} <= pages
    wrong, produced = [], {page: [DEMO_OUTPUT] for page in pages}
    for page, args in commands:
        for problem in check_command(args, produced[page]):
            wrong.append(f"{page}: r1fit {shlex.join(args)}\n    {problem}")
    assert not wrong, "commands in the manual that would fail when pasted:\n" + "\n".join(wrong)


def test_commands_are_found_as_pasted():
    text = (
        "```bash\npip install -e . && r1fit train   # the demo\n"
        "torchrun --standalone --nproc-per-node 8 -m r1fit train c.yaml \\\n    data.train=/data/t.jsonl\n"
        "HF_HUB_OFFLINE=1 r1fit plan c.yaml --gpus 8\n```\n"
        "```\n$ r1fit config a=1\nr1fit plan: output, not a command\n```\n"
        "```python\nr1fit train  # not a shell block\n```\n"
        "```text\nr1fit train\n```\n")
    assert commands_in(text) == [["train"], ["train", "c.yaml", "data.train=/data/t.jsonl"],
                                 ["plan", "c.yaml", "--gpus", "8"], ["config", "a=1"]]


@pytest.mark.parametrize(("command", "problem"), [
    ("r1fit train configs/qwen2.5-vl-3b-lora.yaml data.train=/data/t.jsonl data.evl=/data/v.jsonl",
     "data.evl"),
    ("r1fit train configs/missing.yaml", "config file not found"),
    ("r1fit train algo.num_generations=0", "algo.num_generations"),
    # the README's torchrun line as it was: the config's relative data.eval is not there
    ("torchrun --standalone --nproc-per-node 8 -m r1fit train configs/qwen2.5-vl-3b-lora.yaml "
     "data.train=/data/train.jsonl", "data.eval=data/val.jsonl"),
    ("r1fit train data.train=/home/me/train.jsonl", "data.train=/home/me/train.jsonl"),
    ("r1fit train model.path=runs/sft/final", "model.path=runs/sft/final"),
    ("r1fit plan configs/qwen2.5-vl-3b-lora.yaml --device-memory 80 gigs", "'gigs'"),
    ("r1fit plan configs/qwen2.5-vl-3b-lora.yaml --device-memory lots", "--device-memory"),
    ("r1fit report", "does not parse"),
    ("r1fit inspect runs/elsewhere", "path=runs/elsewhere"),
    # vllm.md's line as it was: no config, so a full fine-tuning of the 3B on builtin:shapes
    ("r1fit train rollout.engine=vllm model.path=Qwen/Qwen2.5-VL-3B-Instruct", "built-in task"),
])
def test_a_wrong_command_is_caught(at_root, command, problem):
    (args,) = commands_in(f"```bash\n{command}\n```\n")
    problems = check_command(args, [DEMO_OUTPUT])
    assert any(problem in p for p in problems), problems


def test_right_commands_pass(at_root):
    produced = [DEMO_OUTPUT]
    for command in ("r1fit train", "r1fit report runs/demo", "r1fit doctor --check",
                    "r1fit sft configs/zoom-tools.yaml train.output_dir=runs/zoom-sft",
                    "r1fit train configs/zoom-tools.yaml model.path=runs/zoom-sft/final",
                    "r1fit train configs/qwen2.5-vl-3b-lora.yaml data.train=hiyouga/geometry3k@train "
                    "data.eval=null",
                    "r1fit plan configs/qwen2.5-vl-3b-lora.yaml --sft --gpus 8 --device-memory 80GiB"):
        (args,) = commands_in(f"```bash\n{command}\n```\n")
        assert check_command(args, produced) == [], command
