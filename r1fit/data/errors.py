"""Errors raised by the data layer.

Both are ``ValueError`` subclasses so a CLI can catch bad input in one place and print the one-line
message instead of a traceback.
"""

from __future__ import annotations

from r1fit.errors import R1fitError


class DataError(R1fitError, ValueError):
    """A whole data source is unusable: missing/empty file, too many bad rows, bad dataset options."""


class BadRowError(R1fitError, ValueError):
    """One row (or one image) cannot be used; the message names the file (and line) at fault.

    Rows that are bad at load time are skipped and counted by the reader; rows whose images only fail
    when decoded later raise this from ``PromptDataset[i]`` so the training loop can skip and count them.
    """
