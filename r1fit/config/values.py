"""Config values: a YAML or ``key=value`` value checked against its field's annotation (with YAML's
string coercions) and bounds, and written into a copy of the frozen tree, each bad value a one-line
:class:`ConfigError` naming the key."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml

from r1fit.errors import R1fitError


class ConfigError(R1fitError, ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


class ReadOnlyDict(dict):
    """A mapping field of the frozen config tree (``rewards``): readable like a dict, never
    changed in place (a changed config is a new one, see :meth:`Config.with_values`)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the config is read-only after validation; use Config.with_values()")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict[int, Any]) -> ReadOnlyDict:
        return ReadOnlyDict(copy.deepcopy(dict(self), memo))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    name = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
    return name.get(getattr(tp, "__name__", ""), str(tp))


def _number(value: Any, tp: type, bad: ConfigError) -> int | float:
    """An int or float from a number or a numeric string; bools and fractional ints are bad."""
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        try:
            value = float(value) if tp is float else int(value)
        except ValueError:
            raise bad from None
    if tp is int and isinstance(value, float):
        if not value.is_integer():
            raise bad
        value = int(value)
    if isinstance(value, (int, float)):
        return tp(value)
    raise bad


class DecimalLoader(yaml.SafeLoader):
    """YAML's safe loader with integers written with a leading zero read in base 10: YAML 1.1
    (PyYAML's) reads ``010`` as octal 8, which no one writing ``num_generations: 010`` means."""


def _decimal_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    digits = text.lstrip("+-")
    if len(digits) > 1 and digits[0] == "0" and digits.isdigit():
        return int(text, 10)
    return loader.construct_yaml_int(node)


DecimalLoader.add_constructor("tag:yaml.org,2002:int", _decimal_int)


class Override(str):
    """A ``key=value`` override's value: its text as typed, and ``parsed``, that text read as
    YAML. A key whose type is a string takes the text (``Answer: briefly``, ``1.10``, ``007``,
    ``2024-05-01`` and ``a # b`` stay as typed; YAML would make them a mapping, 1.1, 7, a date
    and ``a``), unless it is quoted (``""`` is the empty string) or a YAML list or mapping
    (``[a.jsonl, b.jsonl]``); any other key, the YAML."""

    parsed: Any

    @classmethod
    def of(cls, raw: str) -> Override:
        text = raw.strip()
        try:
            parsed = yaml.load(text, Loader=DecimalLoader) if text else ""  # noqa: S506 (safe)
        except yaml.YAMLError:
            parsed = text
        quoted = text[:1] in ("'", '"') and isinstance(parsed, str)
        value = cls(parsed if quoted else text)
        value.parsed = parsed
        return value


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (with YAML-ish string coercion)."""
    if isinstance(value, Override):
        if value[:1] in "[{" and isinstance(value.parsed, (list, dict)):  # [a, b], {a: 1}
            value = value.parsed
        elif tp is str:
            return str(value)
        elif typing.get_origin(tp) not in (typing.Union, types.UnionType):
            value = value.parsed  # a union tries each of its types with the override whole
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: got {value!r}, expected {_describe(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        if isinstance(value, str) and value.lower() in ("null", "none", "~") and \
                type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise bad
    if tp in (int, float):
        return _number(value, tp, bad)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if origin in (list, tuple):
        item_tp = typing.get_args(tp)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise bad
        return {str(k): _coerce(f"{key}.{k}", v, val_tp) for k, v in value.items()}
    raise bad


def _check_bounds(key: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: got {value!r}, expected a finite number")
    if meta.get("ge") is not None and value < meta["ge"]:
        raise ConfigError(f"{key}: got {value!r}, expected a number >= {meta['ge']}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        raise ConfigError(f"{key}: got {value!r}, expected a number > {meta['gt']}")
    if meta.get("le") is not None and value > meta["le"]:
        raise ConfigError(f"{key}: got {value!r}, expected a number <= {meta['le']}")


def apply(obj: Any, data: dict[str, Any], prefix: str) -> Any:
    """A copy of the dataclass ``obj`` with a nested mapping written into it, each leaf
    validated."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(f"{where}: got {data!r}, expected a mapping of its keys "
                          f"({', '.join(f.name for f in dataclasses.fields(obj))})")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = _hints(type(obj))
    changes: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown key '{key}'; allowed here: {', '.join(fields)}")
        current = changes.get(name, getattr(obj, name))
        if dataclasses.is_dataclass(current):
            # a file's section whose keys are all commented out is None: nothing set in it
            section = value.parsed if isinstance(value, Override) else ({} if value is None
                                                                        else value)
            changes[name] = apply(current, section, key + ".")
            continue
        value = _coerce(key, value, hints[name])
        _check_bounds(key, value, fields[name].metadata)
        if isinstance(value, dict):
            for k, v in value.items():
                _check_bounds(f"{key}.{k}", v, fields[name].metadata)
            value = ReadOnlyDict(value)
        elif isinstance(value, list):
            value = tuple(value)
        changes[name] = value
    return dataclasses.replace(obj, **changes)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value (e.g. algo.num_generations=8)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    return key.split("."), Override.of(raw)


def nest(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def changed(cfg: Any, changes: list[tuple[list[str], Any]]) -> Any:
    """``cfg`` with each (dotted path, value) applied in order (each value checked, the whole
    not)."""
    for keys, value in changes:
        if keys[0] == "rewards" and len(keys) > 1:
            # a reward name may contain dots ('pkg.mod:fn'): everything after 'rewards.' is the name
            cfg = apply(cfg, {"rewards": {**cfg.rewards, ".".join(keys[1:]): value}}, "")
            continue
        cfg = apply(cfg, nest(keys, value), "")
    return cfg


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A resolved config (``Config.to_dict``) as dotted keys; ``rewards`` is one leaf."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and prefix + key != "rewards":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two resolved configs: ``{key: (saved, now)}``
    (a checkpoint's and a resume's, two processes')."""
    a, b = flatten(saved), flatten(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k != "kind"}
