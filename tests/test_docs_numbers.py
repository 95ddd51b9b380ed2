"""Every measurement the README (and docs/index.md, its copy in the manual) quotes is in the newest
row of its benchmark in RESULTS.md.

The rule, as checked here:

- **Numbers.** In the page's prose, tables and untyped (output) code blocks, leaving out inline
  code, link targets and the other code blocks (commands and config values): a number glued to
  `x` or `%` (`8.6x`, `+1.1%`, sign kept), a duration `M min S s`, a number followed by a unit
  (`ms`, `s`, `min`, `h`, spelt out too, `MiB`, `GiB`, `MB`, `GB`, `GB/s`, `tokens/s`, `tok/s`;
  a space or line break between), and a fraction written with two or more decimals (`0.725`,
  `1.000`: accuracies). Versions (`2.14.1`) are not numbers.
- **Its benchmark.** A paragraph, table row or output block names the RESULTS.md section
  it quotes: a link to the section's anchor (`benchmarks/RESULTS.md#...`) or the script its
  heading names (`benchmarks/tools_learning.py`). A table or output block without a name of its
  own takes the paragraph's before it. A unit that quotes a number and names no section fails.
- **The newest row.** Within a section's table (newest first), a row is current when no row
  above it ran the same command on the same machine (the command's backticked text, without
  `time`, a leading `python`/`python3 [-m]`, `--budget N` and `train.output_dir=...`; "same"
  means the row above's). The number must appear, with the same digits (and sign and unit for `x` and
  `%`), in a current row of a named section; when the unit names a command in backticks that
  begins a current row's command (compared the same way), in one of those rows. So a
  number from a row since superseded fails, so does one from a row of another command than the
  one named, and so does one no row holds.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FRONT_PAGES = (README, ROOT / "docs" / "index.md")
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

VERSION = re.compile(r"\d+\.\d+\.\d+")
DURATION = re.compile(r"(?<![\w.])\d+ min \d+ s\b")
GLUED = re.compile(r"(?<![\w.,+-])[+-]?\d[\d,]*(?:\.\d+)?(?:x|%)(?![\w%])")
WITH_UNIT = re.compile(r"(?<![\w.,+-])(\d[\d,]*(?:\.\d+)?)\s?(?:ms|s|seconds|min|minutes|h|hours|MiB|GiB|MB|GB"
                       r"|GB/s|tokens/s|tok/s)(?![\w/])")
FRACTION = re.compile(r"(?<![\w.,+-])[01]\.\d{2,}(?![\w.])")
SCRIPT = re.compile(r"benchmarks/(\w+\.py)")
ANCHOR = re.compile(r"(?:RESULTS|results)\.md#([\w-]+)")


def slug(heading: str) -> str:
    """mkdocs' (Python-Markdown's toc) anchor of a heading."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def quoted_numbers(text: str) -> list[str]:
    """The numbers of a README unit (prose or table, no code) as the rule above reads them."""
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = VERSION.sub(" ", text)
    found = DURATION.findall(text)
    text = DURATION.sub(" ", text)
    found += GLUED.findall(text)
    text = GLUED.sub(" ", text)
    found += WITH_UNIT.findall(text)
    text = WITH_UNIT.sub(" ", text)
    return found + FRACTION.findall(text)


def appears(number: str, row: str) -> bool:
    """The number's digits (and sign and unit, when glued to x or %) stand alone in the row."""
    forms = {number, number.replace(",", "")}
    return any(re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d]|[.,]\d)", row) for form in forms)


def normal_command(text: str) -> str:
    """A command as rows and pages are compared: without `time`, `python3`/`python`, `-m` before
    r1fit, `--budget N` and `train.output_dir=...`."""
    text = re.sub(r"\btime |PYTHONUNBUFFERED=1 |--budget \d+|train\.output_dir=\S+", " ", text)
    text = re.sub(r"^\s*python3? (-m )?", "", text)
    return " ".join(text.split())


def command_key(machine: str, command: str, previous: tuple[str, str] | None) -> tuple[str, str]:
    if command.strip().startswith(("same", "the same")) and previous is not None:
        return previous
    text = normal_command(" ".join(re.findall(r"`([^`]*)`", command)) or command)
    return machine.split()[0].strip(",;") if machine.split() else "", text


def current_rows(results: str) -> dict[str, dict]:
    """Each RESULTS.md section by anchor: its heading and its current rows (command, text)."""
    sections = {}
    for part in re.split(r"^## ", results, flags=re.M)[1:]:
        heading, body = part.split("\n", 1)
        table = [line for line in body.splitlines() if line.startswith("|")]
        header = [c.strip() for c in table[0].strip("|").split("|")] if table else []
        rows, seen, previous = [], set(), None
        for line in table[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if "command" in header and "machine" in header:
                previous = command_key(cells[header.index("machine")],
                                       cells[header.index("command")], previous)
                if previous in seen:
                    continue
                seen.add(previous)
            rows.append((previous[1] if previous else "", line))
        sections[slug(heading)] = {"heading": heading, "rows": rows}
    return sections


def readme_units(text: str) -> list[tuple[str, str]]:
    """(the text quoting numbers, the text naming their sections) of each paragraph, table row
    and output block; a table row or output block that names no section of its own is named
    by the paragraph before it."""
    units, last_paragraph = [], ""
    for block in re.split(r"(^```[^\n]*\n.*?^```\n)", text, flags=re.S | re.M):
        if block.startswith("```"):
            if block.startswith("```\n"):  # an output block; other blocks are code
                units.append((block, last_paragraph))
            continue
        for paragraph in re.split(r"\n\s*\n|^#+ .*$", block, flags=re.M):
            lines = paragraph.strip().splitlines()
            if lines and all(line.startswith("|") for line in lines):
                units += [(line, line if named(line) else last_paragraph) for line in lines]
            elif lines:
                last_paragraph = paragraph
                units.append((paragraph, paragraph))
    return units


def named(text: str) -> bool:
    return bool(SCRIPT.search(text) or ANCHOR.search(text))


def named_sections(text: str, sections: dict[str, dict]) -> list[str]:
    """The anchors of the sections a text links to or whose script it names."""
    names = set(ANCHOR.findall(text))
    for script in SCRIPT.findall(text):
        names |= {anchor for anchor, s in sections.items() if f"benchmarks/{script}" in s["heading"]}
    return sorted(names)


def misquoted(readme: str, results: str) -> list[str]:
    """One line per number of the README that breaks the rule above."""
    sections = current_rows(results)
    wrong = []
    for quoting, naming in readme_units(readme):
        numbers = quoted_numbers(quoting)
        if not numbers:
            continue
        names, where = named_sections(naming, sections), " ".join(quoting.split())[:100]
        if not names:
            wrong.append(f"{numbers} quoted, no RESULTS.md section named: {where}")
        for name in names:
            if name not in sections:
                wrong.append(f"no RESULTS.md section #{name}: {where}")
        rows = [row for name in names for row in sections.get(name, {"rows": []})["rows"]]
        commands = [normal_command(span) for span in re.findall(r"`([^`\n]+)`", naming)]
        ran = [text for command, text in rows if any(command.startswith(c) for c in commands if c)]
        rows = ran or [text for _, text in rows]
        wrong += [f"{number} is in no current row of #{', #'.join(names)}: {around(number, quoting)}"
                  for number in numbers if names and not any(appears(number, row) for row in rows)]
    return wrong


def around(number: str, text: str) -> str:
    """The page's words around a number, for the failure message."""
    text = " ".join(text.split())
    at = max(text.find(number), 0)
    return "..." + text[max(at - 50, 0):at + len(number) + 30] + "..."


@pytest.mark.parametrize("page", FRONT_PAGES, ids=lambda page: page.name)
def test_every_number_the_readme_quotes_is_in_the_newest_row_of_its_benchmark(page):
    wrong = misquoted(page.read_text(), RESULTS.read_text())
    assert not wrong, f"{page.name} numbers without a current RESULTS.md row:\n" + "\n".join(wrong)


RESULTS_SAMPLE = """## Demo: `r1fit train`

| date | commit | machine | command | accuracy | wall time |
|---|---|---|---|---|---|
| 2026-11-27 | b | cpu-2c | `time r1fit train train.output_dir=/tmp/a` | 0.25, 0.725 | 2 min 27 s |
| 2026-11-26 | a | cpu-2c | same | 0.25, 0.73 | 3 min 23 s |

## GPU check: `python benchmarks/gpu_check.py`

| date | commit | machine | command | numbers |
|---|---|---|---|---|
| 2026-11-27 | d | h200 (1 s) | `python3 benchmarks/gpu_check.py --only speed --budget 9` | 12,644 tokens/s (8.6x) |
| 2026-11-26 | c | h100 (2 s) | `python3 benchmarks/gpu_check.py --only plan --budget 5` | plan **+1.1%: met** |
| 2026-11-25 | b | h100 | `python3 benchmarks/gpu_check.py --only plan` | plan -7.0% |
"""


def test_the_rule_reads_rows_commands_and_units():
    sections = current_rows(RESULTS_SAMPLE)
    assert list(sections) == ["demo-r1fit-train", "gpu-check-python-benchmarksgpu_checkpy"]
    assert len(sections["demo-r1fit-train"]["rows"]) == 1  # "same" command: superseded
    assert len(sections["gpu-check-python-benchmarksgpu_checkpy"]["rows"]) == 2  # -7.0% superseded
    assert quoted_numbers("in 2 min 27 s, 8.6x (`algo.beta=0.04`), -0.3% to +1.1%, 13,271 tokens/s, "
                          "accuracy 0.725, torch 2.14.1, 0.36M parameters, Python 3.11+, about 9\nminutes") == \
        ["2 min 27 s", "8.6x", "-0.3%", "+1.1%", "13,271", "9", "0.725"]
    assert appears("12644", "12,644 tokens/s") is False and appears("12,644", "12,644 tokens/s")
    assert not appears("1.1%", "+11.1%") and appears("+1.1%", "**+1.1%: met**")


def test_a_stale_or_unnamed_number_is_caught():
    good = ("Last run [results](RESULTS.md#demo-r1fit-train): 0.725 in 2 min 27 s.\n\n"
            "Decode (`python3 benchmarks/gpu_check.py --only speed`): 8.6x HF's tokens/s.\n")
    assert misquoted(good, RESULTS_SAMPLE) == []
    for stale, why in [
        ("[results](RESULTS.md#demo-r1fit-train): 0.73 in 2 min 27 s.", "0.73 is in no current row"),
        ("[results](RESULTS.md#demo-r1fit-train): 0.725 in 3 min 23 s.", "3 min 23 s is in no"),
        ("Plans (`benchmarks/gpu_check.py`) -7.0% of the peak.", "-7.0% is in no current row"),
        ("Decode (`python benchmarks/gpu_check.py --only speed`): +1.1%.", "+1.1% is in no current"),
        ("Decode at 8.6x HF's tokens/s.", "no RESULTS.md section named"),
        ("[results](RESULTS.md#nowhere): 8.6x.", "no RESULTS.md section #nowhere"),
    ]:
        assert any(why in line for line in misquoted(stale, RESULTS_SAMPLE)), (stale, why)
    table = ("Measured (`benchmarks/gpu_check.py`):\n\n| a | b |\n|---|---|\n| plan | +1.1% |\n"
             "| plan | +2.2% |\n")
    assert [line.split(" is")[0] for line in misquoted(table, RESULTS_SAMPLE)] == ["+2.2%"]
    output = "The curve [results](RESULTS.md#demo-r1fit-train):\n\n```\n0.25, 0.73\n```\n"
    assert [line.split(" is")[0] for line in misquoted(output, RESULTS_SAMPLE)] == ["0.73"]
