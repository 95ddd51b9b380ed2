"""Model loading: policy/reference from HF folders, hub ids or built-in tiny models; LoRA."""

from r1fit.models.errors import ModelConfigError
from r1fit.models.load import (
    Reference,
    lm_backbone_and_head,
    load_policy,
    resolve_model_path,
    special_token_ids,
    unwrap,
)

__all__ = [
    "ModelConfigError",
    "Reference",
    "lm_backbone_and_head",
    "load_policy",
    "resolve_model_path",
    "special_token_ids",
    "unwrap",
]
