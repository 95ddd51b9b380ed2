"""Tools a policy calls in the middle of its answer ("thinking with images"): the call format
(calls.py), the tool API (api.py), the built-in ``crop`` and ``zoom`` (builtin.py), the registry
and the runner with its timeout and counts (registry.py), the tool turn appended to a conversation
(conversation.py: its messages, and its tokens as a rollout appends them), and SFT's tool
demonstrations (demonstrations.py). See docs/tools.md.

GRPO runs them in its multi-turn rollouts (r1fit/rollout/turns.py, r1fit/train/tool_rollouts.py)
when ``tools`` are configured.
"""

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
from r1fit.tools.calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from r1fit.tools.conversation import append_tool_turn, tool_turn_content
from r1fit.tools.registry import BUILTIN_TOOLS, ToolCounts, ToolRunner, ToolStats, resolve_tool

__all__ = [
    "BUILTIN_TOOLS", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "MalformedCall", "ToolArgumentError",
    "ToolCall", "ToolConfigError", "ToolContext", "ToolCounts", "ToolPart", "ToolResult",
    "ToolRunner", "ToolStats", "append_tool_turn", "crop", "parse_tool_calls", "resolve_tool",
    "tool_turn_content", "zoom",
]
