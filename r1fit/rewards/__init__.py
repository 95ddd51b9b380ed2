"""Reward functions for GRPO and the registry that combines them.

The contract
------------
A reward function scores ONE completion::

    def my_reward(completion: str, solution: str, **info) -> float:
        ...

- ``completion``: the generated text only, without the prompt.
- ``solution``: the dataset row's ``solution`` field, unchanged (tagged ``<answer>..</answer>`` or
  a bare answer; :func:`extract_answer` with ``untagged_is_answer=True`` handles both).
- ``info``: extra keyword arguments; it always holds ``problem: str`` (the prompt's question text)
  and ``reward_method: str`` (the row's accuracy method, see below) when the rows come from r1fit's
  data, and may gain keys in later versions, so a reward MUST accept ``**info`` (this is checked
  when the reward is resolved).
- Return a finite float, typically in [0, 1]. ``int``, ``bool``, numpy scalars and one-element
  tensors are accepted too.

Exceptions and non-finite or non-number returns do not stop training: that sample's component is
0, the failure is counted (``RewardResult.errors``, ``RewardScorer.total_errors``) and the first
traceback of each reward is logged once to the ``r1fit.rewards`` logger.

Using rewards
-------------
Name rewards in the config as ``{name: weight}``; a name is a built-in (``accuracy``, ``format``,
``iou``, ``iou_hit``) or ``"package.module:function"`` for your own function, importable from
``sys.path``::

    scorer = RewardScorer({"accuracy": 1.0, "format": 0.5, "my_pkg.rewards:length_penalty": -0.1})
    result = scorer.score(completions, solutions, [{"problem": p} for p in problems])
    result.total        # [N] float32 weighted sum, used for advantages
    result.components   # name -> [N] unweighted scores, for logging

Accuracy methods
----------------
The ``accuracy`` reward compares the completion's last ``<answer>`` with the solution by the
row's method, ``info["reward_method"]`` (``data.reward_method``, or the row's own
``accu_reward_method`` column as in VLM-R1; ``default`` when absent):

- ``default``: normalised answers equal, or math-verify (a dependency) shows them equal; 0/1.
- ``mcq``: the same option letter ("B", "(b)", "B. Paris", "The answer is B"); 0/1.
- ``yes_no``: the same whole word yes/no ("I don't know" says neither); 0/1.
- ``numeric``: the same number ("3.0" == "3", "1,000" == "1000"); 0/1.
- ``math``: as ``default``, but refused at start where math-verify is missing.
- ``fuzzy``: partial credit, the similarity ratio in [0, 1] of the normalised answers.
- ``iou``: partial credit, the IoU of the answers' first ``[x1, y1, x2, y2]`` boxes (as the ``iou``
  reward); ``builtin:shapes`` box questions use it.

:func:`check_method` validates a name (VLM-R1's ``map`` and ``llm`` are not built in: its message
says what to use instead); :func:`score_by_method` scores one completion by a named method. How
they depart from VLM-R1 is listed in :mod:`r1fit.rewards.methods`.
"""

from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.answer import extract_answer, normalize
from r1fit.rewards.format import format_reward
from r1fit.rewards.iou import answers_iou, box_iou, iou, iou_hit, parse_box
from r1fit.rewards.methods import METHODS, check_method, math_equivalent, score_by_method
from r1fit.rewards.registry import (
    BUILTIN_REWARDS,
    RewardConfigError,
    RewardFn,
    RewardInputError,
    RewardResult,
    RewardScorer,
    resolve_reward,
)

__all__ = [
    "BUILTIN_REWARDS",
    "METHODS",
    "RewardConfigError",
    "RewardFn",
    "RewardInputError",
    "RewardResult",
    "RewardScorer",
    "accuracy",
    "answers_iou",
    "box_iou",
    "check_method",
    "extract_answer",
    "format_reward",
    "iou",
    "iou_hit",
    "math_equivalent",
    "normalize",
    "parse_box",
    "resolve_reward",
    "score_by_method",
]
