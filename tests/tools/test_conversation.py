"""The tool turn appended to a conversation, against hand-built messages and Qwen's rendering."""

from __future__ import annotations

import jinja2
import pytest
from PIL import Image

from r1fit.data.batch import chat_messages
from r1fit.data.sample import Sample
from r1fit.models.tokenizer import GEMMA3_CHAT_TEMPLATE, QWEN2VL_CHAT_TEMPLATE
from r1fit.tools import ToolResult, append_tool_turn

ROW_IMAGE = Image.new("RGB", (56, 56), "white")
CROP = Image.new("RGB", (28, 28), "red")
CALL = '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 0.5, "y2": 0.5}}\n</tool_call>'


def prompt() -> list[dict]:
    return chat_messages(Sample([ROW_IMAGE], "What digit is in the corner?", "7", "test#0"), "")


def test_an_image_and_a_text_result_make_one_user_turn():
    messages, images = prompt(), [ROW_IMAGE]
    results = [ToolResult("crop", (CROP,)), ToolResult("zoom", ("error: zoom: x=2 is outside",),
                                                       error=True)]
    grown, grown_images = append_tool_turn(messages, images, "Look closer." + CALL, results)
    assert grown == [
        {"role": "user", "content": [{"type": "image"},
                                     {"type": "text", "text": "What digit is in the corner?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Look closer." + CALL}]},
        {"role": "user", "content": [
            {"type": "text", "text": "<tool_response>\n"},
            {"type": "image"},
            {"type": "text", "text": "\n</tool_response>\n<tool_response>\nerror: zoom: x=2 is "
                                     "outside\n</tool_response>"}]},
    ]
    assert grown_images == [ROW_IMAGE, CROP]
    assert len(messages) == 1 and images == [ROW_IMAGE]  # the inputs are left as they were


def test_text_parts_of_one_result_stay_in_order_around_images():
    grown, images = append_tool_turn([], [], "x", [ToolResult("t", ("a", CROP, "b", "c"))])
    assert grown[-1]["content"] == [{"type": "text", "text": "<tool_response>\na"},
                                    {"type": "image"},
                                    {"type": "text", "text": "bc\n</tool_response>"}]
    assert images == [CROP]


def test_no_results_is_a_caller_bug():
    with pytest.raises(ValueError, match="at least one result"):
        append_tool_turn([], [], "x", [])


def render(template: str, messages: list[dict]) -> str:
    env = jinja2.Environment()
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="<bos>")


def test_the_built_in_qwen_template_renders_what_qwens_tool_role_renders():
    grown, _ = append_tool_turn(prompt(), [ROW_IMAGE], CALL,
                                [ToolResult("crop", (CROP,)), ToolResult("crop", ("text",))])
    # Qwen2.5/Qwen3(-VL)'s templates render role 'tool' messages as one user turn of
    # '\n<tool_response>\n' + content + '\n</tool_response>' each (written out here by hand)
    assert render(QWEN2VL_CHAT_TEMPLATE, grown) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What digit is in the "
        "corner?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>\n"
        "</tool_response>\n<tool_response>\ntext\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_gemma_roles_still_alternate():
    grown, _ = append_tool_turn(prompt(), [ROW_IMAGE], CALL, [ToolResult("crop", (CROP,))])
    text = render(GEMMA3_CHAT_TEMPLATE, grown)  # raises when roles do not alternate
    # Gemma 3's template trims each text part, so the newlines inside the tags go
    assert text.endswith("<start_of_turn>user\n<tool_response><start_of_image></tool_response>"
                         "<end_of_turn>\n<start_of_turn>model\n")
