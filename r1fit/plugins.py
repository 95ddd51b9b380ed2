"""User plugins named ``"package.module:function"``: rewards (``rewards``) and tools (``tools``)
are both found this way, so both say the same things when the name is wrong."""

from __future__ import annotations

import importlib
from typing import Any


def load_plugin(spec: str, what: str, error: type[Exception]) -> Any:
    """The callable that ``"package.module:attr"`` names (``attr`` may be dotted:
    ``module:Class.method``).

    Raises ``error`` with one line naming ``what`` and the spec (``reward 'pkg.mod:fn': ...``) when
    the spec is malformed, the module cannot be imported, the attribute is missing or it is not
    callable.
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise error(f"{what} {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Distinguish "your module does not exist" from "your module imports something missing".
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise error(f"{what} {spec!r}: module {module_name!r} not found on sys.path") from None
        raise error(f"{what} {spec!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure inside the user's module
        raise error(f"{what} {spec!r}: importing {module_name!r} failed: "
                    f"{type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise error(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise error(f"{what} {spec!r}: {attr_path!r} is a {type(target).__name__}, not a function")
    return target
