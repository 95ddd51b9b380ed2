from __future__ import annotations

import pytest

from r1fit.units import format_bytes, format_seconds, parse_bytes


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000 and parse_bytes(2048) == 2048
    for bad in ("", "GiB", "12 parsecs", "0GiB", "-1GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**30 / 2) == "1.50 GiB"
    assert format_bytes(512) == "512 B"


@pytest.mark.parametrize("seconds, shown", [(5e-4, "500 us"), (0.25, "250.0 ms"),
                                            (42.0, "42.0 s"), (750.0, "12.5 min"),
                                            (9000.0, "2.5 h")])
def test_format_seconds(seconds, shown):
    assert format_seconds(seconds) == shown
