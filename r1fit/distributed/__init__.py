"""Several processes: torchrun init and collectives (context), activation checkpointing then FSDP2,
rank-0 loading and gathered weights for generation (parallelize)."""
