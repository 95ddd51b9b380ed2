"""Errors raised by r1fit.models."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """A model path, built-in name or model option is invalid; the message names the culprit."""
