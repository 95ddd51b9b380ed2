"""Tool calls in a completion's text, in the format of Qwen's chat templates (Qwen2.5 and Qwen3,
Qwen3-VL included): a JSON object with the tool's name and its arguments between tags,

    <tool_call>
    {"name": "crop", "arguments": {"x1": 0.5, "y1": 0.0, "x2": 1.0, "y2": 0.5}}
    </tool_call>

any text around it, several calls in one turn allowed. Whitespace around the JSON is ignored (the
templates write a newline on each side). A call that cannot be read becomes a
:class:`~r1fit.tools.api.MalformedCall` whose reason is one line; parsing never raises.
"""

from __future__ import annotations

import json
import re

from r1fit.tools.api import MalformedCall, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
# a reason quotes at most this much of what the policy wrote
_QUOTE = 60
#: the deepest nesting of lists and objects a call may have: a tool's arguments are flat, and a
#: degenerate policy writing ~1,000 nested brackets would otherwise reach Python's recursion limit
#: in the JSON reader (or later, in any code that walks the arguments)
MAX_DEPTH = 32


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` in JSON ``text``, outside strings (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _quote(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _QUOTE else text[:_QUOTE] + "...")


def _read(body: str, text: str) -> ToolCall | MalformedCall:
    """One call from the text between the tags."""
    if (depth := nesting_depth(body)) > MAX_DEPTH:
        return MalformedCall(f"tool call nests {depth} levels deep (at most {MAX_DEPTH}): "
                             f"{_quote(body)}", text)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedCall(f"tool call is not valid JSON ({exc.msg} at character {exc.pos}): "
                             f"{_quote(body)}", text)
    if not isinstance(data, dict):
        return MalformedCall(f"tool call must be a JSON object with 'name' and 'arguments', got "
                             f"{_quote(body)}", text)
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return MalformedCall(f"tool call has no 'name' string: {_quote(body)}", text)
    arguments = data.get("arguments", {})  # a tool without parameters may be called without it
    if not isinstance(arguments, dict):
        return MalformedCall(f"tool call {name!r}: 'arguments' must be a JSON object, got "
                             f"{_quote(json.dumps(arguments))}", text)
    return ToolCall(name.strip(), arguments, text)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The tool calls of a completion, in the order written; ``[]`` when it calls none.

    A ``<tool_call>`` left open at the end (the completion ran out of tokens inside it) is one
    more :class:`MalformedCall`. Text outside the tags is the policy's own and is ignored here.
    """
    calls: list[ToolCall | MalformedCall] = []
    end = 0
    for match in _CALL.finditer(text):
        calls.append(_read(match.group(1), match.group(0)))
        end = match.end()
    rest = text[end:]
    if TOOL_CALL_OPEN in rest:
        opened = rest[rest.index(TOOL_CALL_OPEN):]
        calls.append(MalformedCall(f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}: "
                                   f"{_quote(opened)}", opened))
    return calls
