"""Plain-or-rich output of reports made of blocks: a block is a line of text, or a table
``(headers, rows, right_aligned_column_indexes)``. ``r1fit inspect`` and ``r1fit plan`` use it."""

from __future__ import annotations

from typing import Any


def render_text(blocks: list[Any]) -> str:
    """Blocks are lines (str) or tables ``(headers, rows, right_aligned_columns)``."""
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, str):
            lines.append(block)
            continue
        headers, rows, right = block
        widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
        for row in [headers, *rows]:
            cells = [str(x).rjust(w) if i in right else str(x).ljust(w)
                     for i, (x, w) in enumerate(zip(row, widths))]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def print_blocks(blocks: list[Any], *, rich: bool) -> None:
    """Print ``blocks`` as aligned plain text, or as rich tables (a terminal)."""
    if not rich:
        print(render_text(blocks))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    for block in blocks:
        if isinstance(block, str):
            console.print(block, highlight=False, markup=False, soft_wrap=True)
            continue
        headers, rows, right = block
        table = Table()
        for i, name in enumerate(headers):
            table.add_column(name, justify="right" if i in right else "left")
        for row in rows:
            table.add_row(*(Text(str(x)) for x in row))  # Text: no markup in "[...]"
        console.print(table)
