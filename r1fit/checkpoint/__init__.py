"""Crash-safe checkpoints: one manager for everything with ``state_dict()``, atomic saves,
resume, inspection and export."""
