"""The config reference: every leaf key with its default and help text (``r1fit config
--reference``; docs/reference/config.md is this output)."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from r1fit.config.schema import Config


def iter_fields(cls: type = Config, prefix: str = "") -> typing.Iterator[tuple[str, Any, str]]:
    """Yield (dotted key, default, help) for every leaf of the config tree."""
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            yield from iter_fields(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.metadata.get("help", "")


def config_reference_markdown() -> str:
    """The config reference table (docs/reference/config.md embeds this output)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, help_text in iter_fields():
        shown = json.dumps(default) if not isinstance(default, str) or not default else default
        rows.append(f"| `{key}` | `{shown}` | {help_text} |")
    return "\n".join(rows)
