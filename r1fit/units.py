"""Byte sizes as people write them: ``80GiB``, ``512MiB``, ``1.5GB``, ``1000000``."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """``"80GiB"`` -> 85899345920. Raises ValueError naming the accepted units."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write e.g. 80GiB, 512MiB, 1.5GB or a "
                             "number of bytes")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be > 0")
    return size


def parse_memory(text: str | int | float) -> int:
    """:func:`parse_bytes` of a device's memory: a number alone under 1 MiB is refused as a
    forgotten unit (``80`` would be 80 bytes); byte counts as large as a device's are taken."""
    size = parse_bytes(text)
    bare = str(text).strip()
    if bare.isdigit() and size < 2**20:
        raise ValueError(f"{bare} is {bare} bytes; give a unit, e.g. {bare}GiB")
    return size


_BINARY = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DECIMAL = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_bytes(size: float, *, decimal: bool = False) -> str:
    """1.50 GiB, 12.00 MiB, 512 B; with ``decimal`` (file sizes) 1.5 GB, 12.0 MB."""
    for unit, scale in _DECIMAL if decimal else _BINARY:
        if abs(size) >= scale:
            return f"{size / scale:.{1 if decimal else 2}f} {unit}"
    return f"{int(size)} B"


def format_seconds(x: float) -> str:
    """Seconds for a reader: us and ms below one second, s below two minutes, min below two
    hours, else hours."""
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    if x < 120:
        return f"{x:.1f} s"
    return f"{x / 60:.1f} min" if x < 7200 else f"{x / 3600:.1f} h"
