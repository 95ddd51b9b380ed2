"""The manual (README.md and docs/) stays true to the code it documents."""

from __future__ import annotations

import re
from pathlib import Path

from r1fit.config import config_reference_markdown, iter_fields

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference" / "config.md"
SECTIONS = ("model", "data", "algo", "train", "sft", "memory", "rollout", "eval", "checkpoint", "report")
# a dotted key, as docs write it in code: `algo.beta`, `memory.micro_batch=auto`, `rollout.vllm.sleep_level`
KEY = re.compile(rf"(?<![\w/.-])((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_.]*[a-z0-9_])(?![\w*<(/-])")
FILE_SUFFIXES = (".py", ".html", ".json", ".jsonl", ".yaml", ".md", ".txt", ".db", ".safetensors", ".png")
# a git commit in prose (7 to 40 hex digits with a digit and a letter): history lives in RESULTS.md
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def manual_pages() -> list[Path]:
    """README.md and every docs page but the benchmark history (docs/results.md links to it)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if not p.is_symlink()]


def code_spans(text: str) -> list[str]:
    """The text of fenced code blocks and of inline `code` spans."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def named_keys(text: str) -> set[str]:
    keys = set()
    for span in code_spans(text):
        for key in KEY.findall(span):
            if not key.endswith(FILE_SUFFIXES):
                keys.add(key)
    return keys


def test_config_reference_page_is_current():
    assert config_reference_markdown() in REFERENCE.read_text(), \
        "docs/reference/config.md is stale: paste the output of `r1fit config --reference`"


def test_every_config_key_the_manual_names_exists():
    known = {key for key, _, _ in iter_fields()}
    sections = {key.rsplit(".", n)[0] for key in known for n in range(1, key.count(".") + 1)}
    missing = {}
    for page in manual_pages():
        for key in named_keys(page.read_text()):
            if key not in known and key not in sections:
                missing.setdefault(page.relative_to(ROOT).as_posix(), []).append(key)
    assert not missing, f"config keys the manual names that do not exist: {missing}"


def test_the_key_scan_finds_keys_and_skips_files():
    text = "Set `algo.beta=0 memory.micro_batch=auto` and\n```\nr1fit train rollout.vllm.sleep_level=2\n```\n" \
           "not `report.html`, `r1fit/train/grpo.py` or `memory.*_batch`."
    assert named_keys(text) == {"algo.beta", "memory.micro_batch", "rollout.vllm.sleep_level"}


def test_no_commit_hashes_in_the_manual():
    found = {}
    for page in manual_pages():
        hits = COMMIT.findall(page.read_text())
        if hits:
            found[page.relative_to(ROOT).as_posix()] = hits
    assert not found, f"commit hashes in prose (dated rows belong in benchmarks/RESULTS.md): {found}"


def test_the_planner_grid_size_the_memory_page_states_is_the_grid():
    """docs/memory.md says how many configurations benchmarks/plan_accuracy.py's grid holds."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchkit import load_script

    grid = load_script("plan_accuracy").GRID
    sft = sum(name.startswith("sft-") for name in grid)
    text = (ROOT / "docs" / "memory.md").read_text()
    assert f"The grid ({len(grid)} configurations, {sft} of them SFT)" in text
