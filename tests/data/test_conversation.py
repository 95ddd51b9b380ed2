"""SFT targets of multi-turn rows: text conversations scored on their assistant turns, and
conversations with tool turns laid out token for token as the multi-turn rollout lays out the
same conversation (checked against ``run_trajectories`` with a scripted policy)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from r1fit.data.batch import Prompt, chat_messages, encode_prompts
from r1fit.data.conversation import conversation_target
from r1fit.data.dataset import load_dataset
from r1fit.data.sample import Sample
from r1fit.data.shapes import ShapesSpec
from r1fit.rollout.record import Trajectory
from r1fit.rollout.turns import TurnBudgets, run_trajectories
from r1fit.tools import ToolContext, ToolRunner
from r1fit.tools.demonstrations import ToolDemonstrations, tool_turn_text

SYSTEM = "Use the tools, then answer."
CROP = '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 0.5, "y2": 0.5}}\n</tool_call>'
ZOOM = '<tool_call>\n{"name": "zoom", "arguments": {"x": 0.75, "y": 0.25, "factor": 4}}\n</tool_call>'
ANSWER = "<think>The corner is blue.</think><answer>blue</answer>"


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return AutoProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def end_of_turn(processor) -> int:
    return processor.tokenizer.convert_tokens_to_ids("<|im_end|>")


def tool_runner() -> ToolRunner:
    return ToolRunner(["crop", "zoom"], timeout=5.0, min_pixels=28 * 28, max_pixels=56 * 56)


def test_a_text_conversation_scores_its_assistant_turns_with_their_close(processor, end_of_turn):
    turns = (("user", "Is there a square?"), ("assistant", "Yes."),
             ("user", "What colour?"), ("assistant", "red"))
    sample = Sample(images=[], problem="What colour?", solution="red", source="t", turns=turns)
    prompt, ids, mask = conversation_target(processor, sample, "", "<answer>red</answer>",
                                            end_of_turn=end_of_turn)
    assert prompt.sample.turns == turns[:2]  # the prompt runs to the first assistant turn
    assert prompt.completion_inputs == {}
    decode = processor.tokenizer.decode
    scored = decode(ids[mask.bool()].tolist())
    context = decode(ids[~mask.bool()].tolist())
    assert scored == "Yes.<|im_end|>\n<answer>red</answer><|im_end|>\n"
    assert context == "<|im_start|>user\nWhat colour?<|im_end|>\n<|im_start|>assistant\n"
    # prompt + completion is the whole conversation as the chat template renders it
    whole = processor.apply_chat_template(
        [{"role": r, "content": [{"type": "text", "text": t}]}
         for r, t in turns[:-1] + (("assistant", "<answer>red</answer>"),)], tokenize=False)
    (encoded,) = encode_prompts(processor, [prompt.sample], "")
    assert torch.equal(encoded.input_ids, prompt.input_ids)
    assert decode(prompt.input_ids.tolist() + ids.tolist()) == whole
    # one answer to learn: the usual prompt + answer
    single = Sample(images=[], problem="q", solution="a", source="t",
                    turns=(("user", "q"), ("assistant", "a")))
    assert conversation_target(processor, single, "", "a", end_of_turn=end_of_turn) is None


class Scripted:
    """A policy that writes ``texts[k]`` in its k-th turn (k: the tool turns in its context) and
    ends a text without a call with ``eos``."""

    def __init__(self, processor, texts: list[str], eos: int) -> None:
        self.tokenizer, self.texts, self.eos = processor.tokenizer, texts, eos

    def __call__(self, rows: Sequence[Prompt], seeds, limits,
                 previous=None) -> list[torch.Tensor]:
        out = []
        for row in rows:
            text = self.texts[self.tokenizer.decode(row.input_ids.tolist()).count("<tool_response>")]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(torch.tensor(ids if text.endswith("</tool_call>") else [*ids, self.eos]))
        return out


def rollout(processor, sample: Sample, texts: list[str], eos: int) -> Trajectory:
    (trajectory,) = run_trajectories(
        Scripted(processor, texts, eos), processor, encode_prompts(processor, [sample], SYSTEM),
        None, tool_runner(), TurnBudgets(max_turns=4, max_tool_calls=3, max_new_tokens=200,
                                         max_images=4), eos=[eos])
    return trajectory


def assert_same_row(row: Prompt, ids: torch.Tensor, mask: torch.Tensor,
                    trajectory: Trajectory) -> None:
    """SFT's row is the trajectory's row as the log-prob passes run it, token for token."""
    expected = trajectory.row()
    assert ids.tolist() == trajectory.token_ids.tolist()
    assert mask.tolist() == trajectory.policy_mask.tolist()
    assert torch.equal(row.input_ids, expected.input_ids)
    for got, want in ((row.token_inputs, expected.token_inputs),
                      (row.image_inputs, expected.image_inputs),
                      (row.completion_inputs, expected.completion_inputs)):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def corner_sample() -> Sample:
    """A 56 px prompt image from a 112 px source whose top-left quarter is blue."""
    source = Image.new("RGB", (112, 112), (255, 0, 0))
    source.paste((0, 0, 255), (0, 0, 56, 56))
    return Sample([source.resize((56, 56))], "What colour is the top-left corner?", "blue",
                  "test#0", source_images=(source,))


def test_a_conversation_with_two_tool_turns_is_the_rollouts_trajectory(processor, end_of_turn):
    sample = corner_sample()
    trajectory = rollout(processor, sample, [CROP, ZOOM, ANSWER], end_of_turn)
    assert [len(t.results) for t in trajectory.turns] == [1, 1, 0]
    assert len(trajectory.images) == 2 and trajectory.ended == "eos"
    # the same conversation as a row: each tool turn holds what the tool returns
    context = ToolContext(sample.source_images, sample.source)
    turns, images = [("user", "<image>" + sample.problem)], list(sample.images)
    for call in (CROP, ZOOM):
        text, shown = tool_turn_text(tool_runner().run_text(call, context))
        turns += [("assistant", call), ("tool", text)]
        images += shown
    row = Sample(images, sample.problem, sample.solution, sample.source,
                 turns=(*turns, ("assistant", "blue")), source_images=sample.source_images)
    prompt, ids, mask = conversation_target(processor, row, SYSTEM, ANSWER, end_of_turn=end_of_turn)
    assert_same_row(prompt, ids, mask, trajectory)
    assert prompt.image_inputs["image_grid_thw"].shape[0] == 3  # the prompt's image, then 2 tools'
    assert prompt.sample.images == sample.images and prompt.sample.turns == tuple(turns[:2])
    # the tool turns are context, the calls and the answer (closed by <|im_end|>) are learned
    decode = processor.tokenizer.decode
    assert decode(ids[mask.bool()].tolist()) == CROP + ZOOM + ANSWER + "<|im_end|>"
    # a tool turn's close and the prompt's image aside, this is the whole conversation as the
    # processor encodes it
    whole = processor.apply_chat_template(chat_messages(row, SYSTEM, answer=True)[:-1] + [
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}], tokenize=False)
    encoded = processor(text=[whole], images=images, return_tensors="pt")["input_ids"][0]
    assert encoded.tolist() == prompt.input_ids.tolist() + ids.tolist() + \
        processor.tokenizer("\n", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tool", ["zoom", "crop"])
def test_a_zoom_rows_demonstration_is_the_rollout_of_a_policy_writing_it(processor, end_of_turn,
                                                                         tool):
    data = load_dataset("builtin:shapes", split="train", min_pixels=28 * 28, max_pixels=56 * 56,
                        max_images=2, max_bad_fraction=0.0, seed=0, size=3,
                        shapes=ShapesSpec(image_size=56, kinds=["zoom"]), keep_source_images=True)
    for index in range(3):
        sample = data[index]
        demonstration = ToolDemonstrations.of([tool], tool_runner()).write(sample)
        call, answer = demonstration.turns[1][1], demonstration.turns[-1][1]
        assert answer == f"<answer>{sample.solution}</answer>"
        trajectory = rollout(processor, sample, [call, answer], end_of_turn)
        assert trajectory.turns[0].calls[0].name == tool and trajectory.tool_errors == 0
        prompt, ids, mask = conversation_target(processor, demonstration, SYSTEM, answer,
                                                end_of_turn=end_of_turn)
        assert_same_row(prompt, ids, mask, trajectory)
        # the demonstration's tool image is the one the rollout's call got
        assert demonstration.images[1].tobytes() == trajectory.images[0].tobytes()
