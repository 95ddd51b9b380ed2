"""Errors raised by r1fit.models."""

from __future__ import annotations

from r1fit.errors import R1fitError


class ModelConfigError(R1fitError, ValueError):
    """A model path, built-in name or model option is invalid; the message names the culprit."""
