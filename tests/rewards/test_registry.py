"""Reward registry and scorer (r1fit/rewards/registry.py)."""

import logging
import math
import textwrap
from pathlib import Path

import pytest
import torch

from r1fit.rewards.registry import (
    BUILTIN_REWARDS,
    RewardConfigError,
    RewardInputError,
    RewardScorer,
    resolve_reward,
)

PLUGIN_SOURCE = textwrap.dedent(
    '''
    import math

    def length_bonus(completion, solution, **info):
        return len(completion) / 10

    def uses_problem(completion, solution, **info):
        return 1.0 if info["problem"] in completion else 0.0

    def raise_on_b(completion, solution, **info):
        if "b" in completion:
            raise RuntimeError("plugin exploded on " + completion)
        return 1.0

    def exits_on_b(completion, solution, **info):
        if "b" in completion:
            raise SystemExit(3)  # a script's sys.exit left in a reward
        return 1.0

    def nan_on_b(completion, solution, **info):
        return math.nan if "b" in completion else 0.5

    def returns_text(completion, solution, **info):
        return "high"

    def huge(completion, solution, **info):
        return {"a": 1e39, "b": 3e38, "c": 1.0}[completion]  # inf in float32, finite, fine

    def no_kwargs(completion, solution):
        return 1.0

    class Graders:
        @staticmethod
        def exact(completion, solution, **info):
            return float(completion == solution)

    NOT_CALLABLE = 3
    '''
)

LOGGER = "r1fit.rewards"


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user reward module on sys.path; returns its module name."""
    (tmp_path / "my_rewards_plugin.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "broken_rewards_plugin.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_plugin"


def infos(n: int, problem: str = "q") -> list[dict[str, str]]:
    return [{"problem": problem} for _ in range(n)]


class TestResolve:
    def test_builtins(self) -> None:
        assert set(BUILTIN_REWARDS) == {"accuracy", "format", "iou", "iou_hit"}
        for name, fn in BUILTIN_REWARDS.items():
            assert resolve_reward(name) is fn

    def test_plugin_function(self, plugin: str) -> None:
        fn = resolve_reward(f"{plugin}:length_bonus")
        assert fn("abcde", "x", problem="q") == 0.5
        assert resolve_reward(f"{plugin}:Graders.exact")("a", "a", problem="") == 1.0

    @pytest.mark.parametrize(
        ("spec", "message"),
        [
            ("acuracy", "unknown reward 'acuracy'"),
            ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
            ("my_rewards_plugin:missing", "has no attribute 'missing'"),
            ("my_rewards_plugin:NOT_CALLABLE", "is a int, not a function"),
            ("my_rewards_plugin:no_kwargs", "must accept **info"),
            ("broken_rewards_plugin:fn", "not_a_real_dependency_xyz"),
            (":fn", "expected 'package.module:function'"),
            ("my_rewards_plugin:", "expected 'package.module:function'"),
        ],
    )
    def test_bad_spec_names_the_spec(self, plugin: str, spec: str, message: str) -> None:
        with pytest.raises(RewardConfigError) as excinfo:
            resolve_reward(spec)
        text = str(excinfo.value)
        assert repr(spec) in text
        assert message in text
        assert "\n" not in text
        assert isinstance(excinfo.value, ValueError)


class TestScorerConstruction:
    @pytest.mark.parametrize(
        ("weights", "message"),
        [
            ({}, "non-empty mapping"),
            ({"accuracy": math.inf}, "'accuracy': weight must be finite"),
            ({"accuracy": math.nan}, "'accuracy': weight must be finite"),
            ({"format": "1"}, "'format': weight must be a number"),
            ({"format": True}, "'format': weight must be a number"),
            ({"nope": 1.0}, "unknown reward 'nope'"),
        ],
    )
    def test_invalid(self, weights: dict, message: str) -> None:
        with pytest.raises(RewardConfigError) as excinfo:
            RewardScorer(weights)
        assert message in str(excinfo.value)


class TestScore:
    def test_weighted_total_by_hand(self) -> None:
        scorer = RewardScorer({"accuracy": 1.0, "format": 0.5, "iou": 0.0})
        completions = [
            "<think>a</think><answer>3</answer>",  # right, well formatted
            "<answer>3</answer>",  # right, bad format
            "<think>a</think><answer>4</answer>",  # wrong, well formatted
            "no tags at all",  # nothing
        ]
        result = scorer.score(completions, ["3"] * 4, infos(4))
        components = result.components
        torch.testing.assert_close(components["accuracy"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
        torch.testing.assert_close(components["format"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
        torch.testing.assert_close(result.components["iou"], torch.zeros(4))
        # total = 1.0 * accuracy + 0.5 * format + 0.0 * iou
        torch.testing.assert_close(result.total, torch.tensor([1.5, 1.0, 0.5, 0.0]))
        assert result.total.dtype == torch.float32 and result.total.shape == (4,)
        assert result.errors == 0 and result.first_error is None

    def test_plugin_and_negative_weight(self, plugin: str) -> None:
        name = f"{plugin}:length_bonus"
        scorer = RewardScorer({"accuracy": 2.0, name: -0.5})
        result = scorer.score(["<answer>7</answer>", "abc"], ["7", "7"], infos(2))
        # "<answer>7</answer>" has 18 chars -> 1.8; "abc" -> 0.3.
        torch.testing.assert_close(result.components[name], torch.tensor([1.8, 0.3]))
        torch.testing.assert_close(result.total, torch.tensor([2.0 - 0.9, -0.15]))

    def test_info_is_passed_through(self, plugin: str) -> None:
        scorer = RewardScorer({f"{plugin}:uses_problem": 1.0})
        batch_infos = [{"problem": "cat", "image_id": 1}, {"problem": "dog", "image_id": 2}]
        result = scorer.score(["a cat", "a cat"], ["", ""], batch_infos)
        torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0]))

    def test_raising_plugin_is_contained_and_logged_once(
        self, plugin: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        name = f"{plugin}:raise_on_b"
        scorer = RewardScorer({name: 1.0, "format": 1.0})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            result = scorer.score(["a", "b1", "b2", "c"], ["", "", "", ""], infos(4))
            again = scorer.score(["b3"], [""], infos(1))
        torch.testing.assert_close(result.components[name], torch.tensor([1.0, 0.0, 0.0, 1.0]))
        torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0, 0.0, 1.0]))
        assert result.errors == 2 and result.errors_by_reward == {name: 2, "format": 0}
        assert result.first_error is not None
        assert "Traceback" in result.first_error
        assert "RuntimeError: plugin exploded on b1" in result.first_error
        assert "sample 1" in result.first_error
        assert again.errors == 1 and "plugin exploded on b3" in (again.first_error or "")
        assert scorer.total_errors == 3 and scorer.errors_by_reward[name] == 3
        records = [r for r in caplog.records if r.name == LOGGER]
        assert len(records) == 1  # 3 failures over 2 calls, one log line
        assert records[0].levelno == logging.WARNING
        assert "plugin exploded on b1" in records[0].getMessage()

    def test_a_reward_that_calls_sys_exit_is_a_reward_error(self, plugin: str) -> None:
        """SystemExit is no Exception: it ended the run with its exit code and no line naming
        the reward. It is a reward error, counted and logged, like any other raise."""
        name = f"{plugin}:exits_on_b"
        result = RewardScorer({name: 1.0}).score(["a", "b"], ["", ""], infos(2))
        torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0]))
        assert result.errors == 1 and "SystemExit: 3" in (result.first_error or "")
        assert f"reward '{name}' raised on sample 1" in (result.first_error or "")

    def test_nan_and_non_number_returns(
        self, plugin: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        nan_name, text_name = f"{plugin}:nan_on_b", f"{plugin}:returns_text"
        scorer = RewardScorer({nan_name: 2.0, text_name: 1.0})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            result = scorer.score(["a", "b"], ["", ""], infos(2))
        torch.testing.assert_close(result.components[nan_name], torch.tensor([0.5, 0.0]))
        torch.testing.assert_close(result.components[text_name], torch.zeros(2))
        torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0]))
        assert not torch.isnan(result.total).any()
        assert result.errors == 3  # one NaN + two strings
        assert result.first_error is not None and "returned nan" in result.first_error
        messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert len(messages) == 2  # once per failing reward
        assert any("returned 'high'" in m for m in messages)

    def test_scores_beyond_float32_are_errors_and_so_is_a_sum_that_overflows(
        self, plugin: str
    ) -> None:
        """1e39 is finite in Python and inf in the float32 tensors: an error scoring 0, as NaN
        is. 3e38 fits, twice it does not: that sample's total is 0 and counted as an error of
        the sum, never an inf that would turn the group's advantages into NaN."""
        name = f"{plugin}:huge"
        scorer = RewardScorer({name: 2.0})
        result = scorer.score(["a", "b", "c"], [""] * 3, infos(3))
        torch.testing.assert_close(result.components[name], torch.tensor([0.0, 3e38, 1.0]))
        torch.testing.assert_close(result.total, torch.tensor([0.0, 0.0, 2.0]))
        assert result.errors_by_reward == {name: 1, "total": 1} and result.errors == 2
        assert "returned 1e+39 (float) on sample 0; expected a finite float (within float32's " \
               "range)" in result.first_error
        assert scorer.errors_by_reward == {name: 1, "total": 1} and scorer.total_errors == 2

    def test_accepts_int_and_tensor_returns(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (tmp_path / "tensor_reward_plugin.py").write_text(
            "import torch\n"
            "def tensor_reward(completion, solution, **info):\n"
            "    return torch.tensor(0.25)\n"
            "def int_reward(completion, solution, **info):\n"
            "    return 1\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        scorer = RewardScorer(
            {"tensor_reward_plugin:tensor_reward": 1.0, "tensor_reward_plugin:int_reward": 1.0}
        )
        result = scorer.score(["x"], [""], infos(1))
        torch.testing.assert_close(result.total, torch.tensor([1.25]))
        assert result.errors == 0

    def test_empty_batch(self) -> None:
        result = RewardScorer({"accuracy": 1.0}).score([], [], [])
        assert result.total.shape == (0,) and result.errors == 0

    @pytest.mark.parametrize(
        ("solutions", "batch_infos", "message"),
        [
            (["3"], infos(2), "2 completions, 1 solutions and 2 infos"),
            (["3", "3"], [{"problem": "q"}, {}], "infos[1] must be a dict with a 'problem' key"),
            (
                ["3", "3"],
                [{"problem": "q"}, {"problem": "q", "solution": "3"}],
                "infos[1] has reserved",
            ),
        ],
    )
    def test_inconsistent_inputs(self, solutions: list, batch_infos: list, message: str) -> None:
        scorer = RewardScorer({"accuracy": 1.0})
        with pytest.raises(RewardInputError) as excinfo:
            scorer.score(["<answer>3</answer>"] * 2, solutions, batch_infos)
        assert message in str(excinfo.value)
