"""Building a config: the defaults, then the preset, then a YAML file, then ``key=value`` overrides,
and where each key's value came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from r1fit.config.schema import Config
from r1fit.config.values import ConfigError, DecimalLoader, Override, apply, changed, parse_override

#: where the preset files live (package data)
PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
PRESETS = ("demo",)


class _UniqueKeys(DecimalLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, and a section given twice loses every key of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: an anchor's keys, meant to repeat
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {seen[key]} and "
                    f"{key_node.start_mark.line + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        return yaml.load(path.read_text(encoding="utf-8"),  # noqa: S506 (a safe loader)
                         Loader=_UniqueKeys) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None


def preset_values(name: str) -> dict[str, Any]:
    """The nested values of preset ``name`` (``r1fit/presets/NAME.yaml``)."""
    return _read_yaml(PRESETS_DIR / f"{name}.yaml")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the preset, then the YAML file (if any), then ``key.sub=value`` overrides;
    validated."""
    return resolve_config(path, overrides)[0]


def resolve_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                   ) -> tuple[Config, dict[str, str]]:
    """:func:`load_config`'s config, and where each leaf key's value came from: 'default',
    'preset NAME', 'file PATH' or 'override'.

    Which preset applies depends on the final ``preset`` and ``model.path`` (a file or an
    override may set either), so they are resolved first without it, then the layers are
    applied in order."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; give a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = _read_yaml(path)
    changes = [parse_override(item) for item in overrides]
    preset = changed(apply(Config(), data, ""), changes).applied_preset()
    preset_data = preset_values(preset) if preset else {}
    cfg = changed(apply(apply(Config(), preset_data, ""), data, ""), changes)
    cfg.check()
    sources = dict.fromkeys(_leaf_keys(cfg.to_dict()), "default")
    sources.update(dict.fromkeys(_leaf_keys(preset_data), f"preset {preset}"))
    # a leaf of the file's; a section the file leaves empty (its keys commented out) sets none
    sources.update({key: f"file {path}" for key in _leaf_keys(data) if key in sources})
    sources.update(dict.fromkeys(_override_keys(changes), "override"))
    return cfg, sources


def _leaf_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a nested mapping's leaves; ``rewards`` is one leaf (a mapping value)."""
    if not isinstance(data, dict) or prefix == "rewards.":
        return [prefix.rstrip(".")]
    return [key for name, value in data.items() for key in _leaf_keys(value, f"{prefix}{name}.")]


def _override_keys(changes: list[tuple[list[str], Any]]) -> list[str]:
    """The leaf keys ``key=value`` overrides set (``rewards.NAME`` sets the ``rewards`` leaf; an
    override of a whole section sets each key it names)."""
    keys = []
    for path, value in changes:
        if path[0] == "rewards":
            keys.append("rewards")
        else:  # an override's text stands for what it parses to (a section's mapping)
            parsed = value.parsed if isinstance(value, Override) else value
            keys.extend(_leaf_keys(parsed, ".".join(path) + "."))
    return keys
