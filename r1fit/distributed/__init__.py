"""Several processes: activation checkpointing then FSDP2 and gathered weights for generation
(parallelize), rank-0 loading (loading). torchrun init and collectives are a lower layer's:
r1fit/processes.py."""
