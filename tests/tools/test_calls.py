"""Tool calls read from a completion's text (Qwen's <tool_call> JSON format)."""

from __future__ import annotations

import json

import pytest

from r1fit.tools import MalformedCall, ToolCall, parse_tool_calls


def test_one_call_as_qwen_templates_write_it_with_text_around():
    text = ("<think>the mark is small</think>Let me look.\n<tool_call>\n"
            '{"name": "crop", "arguments": {"x1": 0.5, "y1": 0, "x2": 1, "y2": 0.5}}\n'
            "</tool_call>")
    (call,) = parse_tool_calls(text)
    assert call == ToolCall("crop", {"x1": 0.5, "y1": 0, "x2": 1, "y2": 0.5},
                            text[text.index("<tool_call>"):])


def test_several_calls_in_order_and_no_call():
    text = ('a<tool_call>{"name": "zoom", "arguments": {"x": 0.1, "y": 0.9}}</tool_call>b'
            '<tool_call> {"name": "crop", "arguments": {}} </tool_call>c')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("zoom", {"x": 0.1, "y": 0.9}),
                                                      ("crop", {})]
    assert parse_tool_calls("<answer>3</answer>") == []
    assert parse_tool_calls("") == []


def test_missing_arguments_means_none():
    (call,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert call == ToolCall("now", {}, '<tool_call>{"name": "now"}</tool_call>')


@pytest.mark.parametrize(("body", "reason"), [
    ('{"name": "crop", "arguments": {"x1": 0.5,}}', "not valid JSON"),
    ("crop(0, 0, 1, 1)", "not valid JSON"),
    ('["crop", {}]', "must be a JSON object with 'name' and 'arguments'"),
    ('{"arguments": {"x1": 0}}', "has no 'name' string"),
    ('{"name": 3}', "has no 'name' string"),
    ('{"name": "crop", "arguments": [0, 0, 1, 1]}', "'crop': 'arguments' must be a JSON object"),
])
def test_malformed_calls_become_one_line_reasons(body, reason):
    text = f"<tool_call>{body}</tool_call>"
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedCall)
    assert reason in call.reason
    assert "\n" not in call.reason
    assert call.text == text


def test_a_malformed_call_does_not_hide_the_good_ones_around_it():
    text = ('<tool_call>{"name": "a"}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [type(c).__name__ for c in calls] == ["ToolCall", "MalformedCall", "ToolCall"]
    assert [calls[0].name, calls[2].name] == ["a", "b"]


def test_a_call_left_open_is_malformed():
    text = '<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "crop", "argu'
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("a", {}, '<tool_call>{"name": "a"}</tool_call>')
    assert isinstance(calls[1], MalformedCall)
    assert calls[1].reason.startswith("<tool_call> without </tool_call>")
    assert calls[1].text == '<tool_call>{"name": "crop", "argu'


def test_a_long_body_is_quoted_short():
    (call,) = parse_tool_calls("<tool_call>" + "x" * 500 + "</tool_call>")
    assert isinstance(call, MalformedCall)
    assert "x" * 60 + "..." in call.reason
    assert len(call.reason) < 200


def test_a_deeply_nested_call_is_malformed_not_a_crash():
    """~1,000 nested brackets (a degenerate policy writes that in ~1,000 tokens) once raised
    RecursionError out of the JSON reader and ended the run."""
    from r1fit.tools.calls import MAX_DEPTH, nesting_depth

    for depth in (1_000, 100_000):
        deep = "<tool_call>" + "[" * depth + "]" * depth + "</tool_call>"
        (call,) = parse_tool_calls(deep)
        assert isinstance(call, MalformedCall)
        assert call.reason.startswith(f"tool call nests {depth} levels deep (at most {MAX_DEPTH})")
    nested_args = {"name": "crop", "arguments": {"box": [[[1]]]}}
    (ok,) = parse_tool_calls(f"<tool_call>{json.dumps(nested_args)}</tool_call>")
    assert not isinstance(ok, MalformedCall)
    # brackets inside strings do not count; escaped quotes do not end a string
    assert nesting_depth('{"a": "[[[{{{", "b": "\\"[[["}') == 1
    assert nesting_depth('[{"a": [1]}]') == 3
