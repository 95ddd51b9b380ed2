"""The typed config tree: one dataclass per section, one help text per field.

A config is built from the defaults (made for pre-trained VLMs; each help text says where its
value comes from), then a preset (``preset``: the built-in demo's values for a random-weight
built-in model, ``r1fit/presets/demo.yaml``), then a YAML file, then dotted ``key.sub=value``
overrides, in that order; ``r1fit config`` shows which of these gave each value. Every field
carries its help text in ``metadata["help"]``; ``r1fit config --reference`` prints them and the
manual's reference page (docs/reference/config.md) is generated from the same text. Unknown keys
and bad values raise :class:`ConfigError` with one line naming the key and what is allowed.

The jobs, one module each: ``schema`` (the dataclasses and ``Config``, whose ``check`` checks a
whole config), ``values`` (a value checked against its field and written into the tree), ``load``
(the layers and each key's source), ``reference`` (the key reference).
"""

from r1fit.config.load import PRESETS, PRESETS_DIR, load_config, preset_values, resolve_config
from r1fit.config.reference import config_reference_markdown, iter_fields
from r1fit.config.schema import (
    FUSED_HEAD_CHUNK,
    R1_SYSTEM_PROMPT,
    RECOMPUTED_HEAD_CHUNK,
    AlgoConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    ReportConfig,
    RolloutConfig,
    SFTConfig,
    ShapesConfig,
    TrainConfig,
    VllmConfig,
    opt,
)
from r1fit.config.values import ConfigError, ReadOnlyDict

__all__ = [
    "FUSED_HEAD_CHUNK", "PRESETS", "PRESETS_DIR", "R1_SYSTEM_PROMPT", "RECOMPUTED_HEAD_CHUNK",
    "AlgoConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
    "LoraConfig", "MemoryConfig", "ModelConfig", "ReadOnlyDict", "ReportConfig", "RolloutConfig",
    "SFTConfig", "ShapesConfig", "TrainConfig", "VllmConfig",
    "config_reference_markdown", "iter_fields", "load_config", "opt", "preset_values",
    "resolve_config",
]
