"""Tool registry and the runner a rollout calls for each tool call.

Tools are named like rewards: a built-in name (``crop``, ``zoom``) or ``"package.module:function"``
for a user tool importable from ``sys.path``. A tool is a plain function
``fn(context: ToolContext, **arguments) -> str | PIL.Image.Image | list[str | PIL.Image.Image]``;
the policy calls it by its function name (``mypkg.tools:rotate`` is called as ``rotate``).

:class:`ToolRunner` runs one call and never raises for anything the policy or the tool did: an
unknown name, arguments the function cannot take, a tool that raises, returns something else or
runs past its timeout each give an error result (one line naming the culprit) and are counted in
:class:`ToolStats`, which the rollout turns into metrics.

The timeout, honestly: each call runs in a new daemon thread and the runner waits at most
``timeout`` seconds for it. Python cannot kill a thread, so a tool that times out is abandoned,
not stopped: it keeps its CPU and memory until it returns by itself (its result is then dropped),
and one that never returns keeps its thread until the process exits (daemon threads do not hold
the exit up). ``ToolStats.stuck`` counts such threads still running. A tool that holds the GIL in
C code also holds up the runner's wait until it lets go. A process per call could be killed, but
would pickle the row's images to it and back on every call; a tool that must be stoppable can
bound its own work.
"""

from __future__ import annotations

import inspect
import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from r1fit.data.images import fit_pixel_budget
from r1fit.errors import one_line
from r1fit.plugins import load_plugin
from r1fit.tools.api import (
    MalformedCall,
    ToolArgumentError,
    ToolCall,
    ToolConfigError,
    ToolContext,
    ToolPart,
    ToolResult,
)
from r1fit.tools.builtin import crop, zoom
from r1fit.tools.calls import parse_tool_calls

logger = logging.getLogger("r1fit.tools")

ToolFn = Callable[..., Any]
"""``fn(context: ToolContext, **arguments) -> str | Image | list[str | Image]``."""

BUILTIN_TOOLS: dict[str, ToolFn] = {"crop": crop, "zoom": zoom}


def _check_signature(spec: str, fn: ToolFn) -> None:
    """Reject a tool that cannot take the context as its first positional argument."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature; trust them
        return
    try:
        signature.bind_partial(None)
    except TypeError:
        raise ToolConfigError(f"tool {spec!r}: must take the row's context first (signature is "
                              f"{getattr(fn, '__name__', spec)}{signature}); write it as "
                              "def fn(context, **arguments)") from None


def resolve_tool(spec: str) -> tuple[str, ToolFn]:
    """``(name the policy calls it by, function)`` for a built-in name or a
    ``"package.module:function"`` spec; :class:`ToolConfigError` (one line naming the spec)
    when it cannot be used."""
    if not isinstance(spec, str) or not spec.strip():
        raise ToolConfigError(f"tool name must be a non-empty string, got {spec!r}")
    if spec in BUILTIN_TOOLS:
        return spec, BUILTIN_TOOLS[spec]
    if ":" not in spec:
        raise ToolConfigError(f"unknown tool {spec!r}: use a built-in "
                              f"({', '.join(sorted(BUILTIN_TOOLS))}) or 'package.module:function'")
    fn = load_plugin(spec, "tool", ToolConfigError)
    _check_signature(spec, fn)
    return spec.rpartition(":")[2].rpartition(".")[2], fn


@dataclass
class ToolCounts:
    """One tool's calls since its counts were last zeroed (a GRPO run adds them to its totals
    and zeroes them each step: :class:`r1fit.train.tool_rollouts.ToolTotals`). ``errors`` are
    calls that gave an error result other than a timeout (bad arguments, the tool raised,
    returned something unusable); ``timeouts`` are calls abandoned after the timeout."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0


@dataclass
class ToolStats:
    """A runner's counts of tool calls, per tool, and of malformed calls (bad JSON, unknown
    tool), which belong to no tool, and its abandoned threads. Not saved: a GRPO run saves its
    totals (:class:`r1fit.train.tool_rollouts.ToolTotals`, which zeroes these on a restore)."""

    tools: dict[str, ToolCounts] = field(default_factory=dict)
    malformed: int = 0
    #: wall seconds the rollouts spent running calls (every row's of a turn at once, with
    #: several workers), since the counts were last zeroed
    seconds: float = 0.0
    _abandoned: list[threading.Thread] = field(default_factory=list, repr=False)

    @property
    def stuck(self) -> int:
        """Threads of timed-out calls still running (they cannot be killed; see the module)."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def metrics(self) -> dict[str, float]:
        """``tools/<name>/calls|errors|timeouts``, ``tools/malformed``, ``tools/stuck`` and
        ``tools/seconds``."""
        out: dict[str, float] = {}
        for name, counts in sorted(self.tools.items()):
            for what in ("calls", "errors", "timeouts"):
                out[f"tools/{name}/{what}"] = float(getattr(counts, what))
        out["tools/malformed"] = float(self.malformed)
        out["tools/stuck"] = float(self.stuck)
        out["tools/seconds"] = float(self.seconds)
        return out


@dataclass
class _Outcome:
    """How a call run in its thread went."""

    finished: bool
    thread: threading.Thread
    value: Any = None
    error: BaseException | None = None
    trace: str = ""


def _run_in_thread(fn: ToolFn, context: ToolContext, arguments: dict[str, Any], timeout: float,
                   name: str) -> _Outcome:
    """``fn(context, **arguments)`` run in a new daemon thread, waited for at most ``timeout``
    seconds."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn(context, **arguments)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit must become an error result
            box["error"], box["trace"] = exc, traceback.format_exc()
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"r1fit-tool-{name}", daemon=True)
    thread.start()
    if not done.wait(timeout):
        return _Outcome(False, thread)
    return _Outcome(True, thread, box.get("value"), box.get("error"), box.get("trace", ""))


class ToolRunner:
    """The run's tools (built-in names or ``"package.module:function"`` specs), each call run with
    a timeout in seconds; every image a tool returns is fitted into ``min_pixels..max_pixels``.

    Raises :class:`ToolConfigError` at construction for a tool that cannot be used, so a misspelt
    name stops the run at start-up rather than failing every call."""

    def __init__(self, specs: Sequence[str], *, timeout: float, min_pixels: int,
                 max_pixels: int) -> None:
        if not timeout > 0:
            raise ToolConfigError(f"tool timeout must be > 0 seconds, got {timeout!r}")
        self.functions: dict[str, ToolFn] = {}
        for spec in specs:
            name, fn = resolve_tool(spec)
            if name in self.functions:
                raise ToolConfigError(f"tool {spec!r}: another tool is already called {name!r}")
            self.functions[name] = fn
        self.timeout = float(timeout)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.stats = ToolStats(tools={name: ToolCounts() for name in self.functions})
        self._logged: set[str] = set()
        # run() is called from several threads at once (a turn's rows: rollout.tool_workers)
        self._lock = threading.Lock()

    def run_text(self, text: str, context: ToolContext) -> list[ToolResult]:
        """The results of every tool call in ``text`` (a completion), in order; ``[]`` when it
        calls none."""
        return [self.run(call, context) for call in parse_tool_calls(text)]

    def run(self, call: ToolCall | MalformedCall, context: ToolContext) -> ToolResult:
        """One call's result; never raises for the policy's or the tool's failures. Safe to call
        from several threads at once (the tool itself must be too)."""
        if isinstance(call, MalformedCall):
            self._count(None)
            return ToolResult.failure("", call.reason)
        fn = self.functions.get(call.name)
        if fn is None:
            self._count(None)
            known = ", ".join(sorted(self.functions)) or "none"
            return ToolResult.failure("", f"unknown tool {call.name!r} (tools: {known})")
        self._count(call.name, "calls")
        problem = self._bad_arguments(fn, call)
        if problem is not None:
            self._count(call.name, "errors")
            return ToolResult.failure(call.name, problem)
        def parts(context: ToolContext, **arguments: Any) -> tuple[ToolPart, ...]:
            # the return value read in the tool's own time too: a lazily opened image is decoded
            # (and may fail, or take long) only when it is fitted to the pixel budget
            return self._parts(fn(context, **arguments))

        outcome = _run_in_thread(parts, context, call.arguments, self.timeout, call.name)
        if not outcome.finished:
            self._count(call.name, "timeouts", abandoned=outcome.thread)
            return ToolResult.failure(call.name, f"timed out after {self.timeout:g} s")
        if outcome.error is not None:  # the tool raised, or returned what cannot be used
            self._count(call.name, "errors")
            return ToolResult.failure(call.name, self._describe(call.name, outcome))
        return ToolResult(call.name, outcome.value)

    def _count(self, name: str | None, what: str = "", *,
               abandoned: threading.Thread | None = None) -> None:
        """Add one to tool ``name``'s ``what`` count (None: a malformed call), under the lock."""
        with self._lock:
            if name is None:
                self.stats.malformed += 1
                return
            counts = self.stats.tools[name]
            setattr(counts, what, getattr(counts, what) + 1)
            if abandoned is not None:
                self.stats._abandoned.append(abandoned)

    @staticmethod
    def _bad_arguments(fn: ToolFn, call: ToolCall) -> str | None:
        """Why ``fn(context, **call.arguments)`` cannot be called, or None."""
        try:
            inspect.signature(fn).bind(None, **call.arguments)
        except TypeError as exc:
            return f"bad arguments {sorted(call.arguments)}: {exc}"
        except ValueError:  # no signature to check against; the call itself will tell
            return None
        return None

    def _describe(self, name: str, outcome: _Outcome) -> str:
        """The one line of an error result; a tool's own bug is also logged once per tool."""
        error = outcome.error
        assert error is not None
        if isinstance(error, ToolArgumentError):
            return one_line(error)
        with self._lock:
            first = name not in self._logged
            self._logged.add(name)
        if first:
            # once per tool: a broken tool fails on every call, and identical tracebacks by the
            # thousand would bury the training log
            logger.warning("tool %r raised:\n%s(further errors of tool %r are counted, not "
                           "logged)", name, outcome.trace, name)
        return f"raised {type(error).__name__}: {one_line(error)}"

    def _parts(self, value: Any) -> tuple[ToolPart, ...]:
        """A tool's return value as result parts, images fitted to the pixel budget."""
        items = list(value) if isinstance(value, list | tuple) else [value]
        if not items:
            raise ToolArgumentError("returned an empty list")
        parts: list[ToolPart] = []
        for item in items:
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:  # a lone surrogate (surrogateescape, fsdecode)
                    raise ToolArgumentError(f"returned text that is not valid Unicode ({exc.reason} "
                                            f"at character {exc.start})") from None
                parts.append(item)
            elif isinstance(item, Image.Image):
                if item.width < 1 or item.height < 1:
                    raise ToolArgumentError(f"returned an empty image ({item.width}x{item.height})")
                try:
                    parts.append(fit_pixel_budget(item, self.min_pixels, self.max_pixels))
                except (OSError, ValueError, SyntaxError) as exc:  # PIL's decoding errors
                    raise ToolArgumentError(f"returned an image that cannot be decoded: "
                                            f"{type(exc).__name__}: {one_line(exc)}") from None
            else:
                raise ToolArgumentError(f"returned {type(item).__name__}; expected text, a PIL "
                                        "image or a list of them")
        return tuple(parts)
