"""Format reward (r1fit/rewards/format.py)."""

import pytest

from r1fit.rewards.format import format_reward


@pytest.mark.parametrize(
    "completion",
    [
        "<think>2+2</think><answer>4</answer>",
        "<think>\nmulti\nline\n</think>\n\n<answer>\n4\n</answer>\n",
        "<think></think> <answer></answer>",
    ],
)
def test_good_format(completion: str) -> None:
    assert format_reward(completion, "4", problem="") == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>4</answer>",  # missing think
        "<think>x</think>",  # missing answer
        "<think>x</think><answer>4</answer><answer>5</answer>",  # two answers
        "<think>x <answer>3</answer></think><answer>4</answer>",  # answer nested in think
        "<think>a</think><think>b</think><answer>4</answer>",  # two thinks
        "<think>x</think><answer>4</answer> so the answer is 4",  # text after answer
        "Sure! <think>x</think><answer>4</answer>",  # text before think
        "<think>x</think> then <answer>4</answer>",  # text between blocks
        "<answer>4</answer><think>x</think>",  # wrong order
        "<think>x</think><answer>4",  # unclosed answer
        "",
    ],
)
def test_bad_format(completion: str) -> None:
    assert format_reward(completion, "4", problem="") == 0.0
