"""Accuracy methods (r1fit/rewards/methods.py) and their dispatch through ``accuracy`` and the
scorer; the ``default`` method's own cases are in test_accuracy.py."""

from decimal import Decimal
from pathlib import Path

import pytest
import torch

from r1fit.errors import R1fitError
from r1fit.rewards import methods, registry
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.methods import (
    METHODS,
    RewardConfigError,
    check_method,
    read_choice,
    read_number,
    read_yes_no,
    score_by_method,
)
from r1fit.rewards.registry import RewardScorer

KNOWN = "default, mcq, yes_no, numeric, math, fuzzy, iou"

# Indel ratio = 1 - (insertions + deletions) / (len(a) + len(b)).
# kitten -> sitting: the longest common subsequence is "ittn" (4), so 6 + 7 - 2 * 4 = 5 edits.
KITTEN_SITTING = 1 - 5 / 13
# "new york" (8) is a subsequence of "new york city" (13): 5 insertions.
NEW_YORK_CITY = 1 - 5 / 21


def tagged(answer: str) -> str:
    return f"<think>...</think><answer>{answer}</answer>"


def test_method_names() -> None:
    assert tuple(METHODS) == ("default", "mcq", "yes_no", "numeric", "math", "fuzzy", "iou")


class TestReadChoice:
    @pytest.mark.parametrize(
        ("answer", "letter"),
        [
            ("B", "B"),
            ("b", "B"),
            ("(b)", "B"),
            ("[C]", "C"),
            ("B.", "B"),
            ("B. Paris", "B"),
            ("B) Paris", "B"),
            ("(B) Paris", "B"),
            ("d: 42", "D"),
            ("**D**", "D"),
            ("The answer is C", "C"),
            ("The answer is C.", "C"),
            ("the answer is (c) because", "C"),
            ("The correct option is B, since", "B"),
            ("Answer: D", "D"),
            ("\\boxed{B}", "B"),  # LaTeX that only frames the letter
            ("$\\boxed{C}$", "C"),
            ("\\text{(B)}", "B"),
        ],
    )
    def test_names_a_letter(self, answer: str, letter: str) -> None:
        assert read_choice(answer) == letter

    @pytest.mark.parametrize(
        "answer",
        [
            "I think C",  # VLM-R1 reads C: any capital followed by the end of text
            "A or B",
            "(B) or (C)",  # a hedge: a lead, then another bracketed option
            "B. Paris [c]",
            "the answer is a dog",  # a lowercase bare letter is a word, not an option
            "The answer is I think B",  # "I" does not end its clause
            "The answer is A. Option B.",  # two letters named: ambiguous
            "e.g. Paris",  # no space after the marker: an abbreviation, not option E
            "Paris",
        ],
    )
    def test_names_no_letter(self, answer: str) -> None:
        assert read_choice(answer) is None


class TestReadYesNoAndNumber:
    @pytest.mark.parametrize(
        ("answer", "word"),
        [
            ("Yes", "yes"),
            ("NO.", "no"),
            ("No, there is no dog, yes", "no"),  # the first one
            ("I don't know", None),  # VLM-R1's substring search reads "no" in "know"
            ("Nobody", None),
            ("maybe", None),
        ],
    )
    def test_yes_no(self, answer: str, word: str | None) -> None:
        assert read_yes_no(answer) == word

    @pytest.mark.parametrize(
        ("answer", "number"),
        [
            ("3", 3.0),
            ("3.0", 3.0),
            ("1,000", 1000.0),
            ("$3.50", 3.5),
            ("\\$1,000", 1000),  # LaTeX's escaped dollar
            ("\u22125", -5),  # the minus sign U+2212
            ("-0.25", -0.25),
            ("1E3", 1000.0),
            ("three", 3.0),
            ("3 apples", None),
            ("1,5", None),  # not a thousands group
            ("50%", None),
            ("1e999", Decimal("1e999")),  # exact: no float to overflow
            ("nan", None),
        ],
    )
    def test_number(self, answer: str, number: float | None) -> None:
        assert read_number(answer) == number

    def test_numbers_compare_exactly_not_through_a_float(self) -> None:
        twenty = "12345678901234567890"  # as floats these two are the same number
        assert float(twenty) == float("12345678901234567891")
        assert score_by_method("numeric", "<answer>12345678901234567891</answer>", twenty) == 0.0
        assert score_by_method("numeric", f"<answer>{twenty}</answer>", twenty) == 1.0
        long = "7" * 5000  # beyond a float: it read as inf and was refused
        assert score_by_method("numeric", f"<answer>{long}</answer>", long) == 1.0


class TestScoreByMethod:
    @pytest.mark.parametrize(
        ("method", "answer", "solution", "expected"),
        [
            ("mcq", "(b)", "B", 1.0),
            ("mcq", "B. Paris", "<answer> B </answer>", 1.0),
            ("mcq", "The answer is C", "(C) Rome", 1.0),
            ("mcq", "B. Paris", "C", 0.0),
            ("mcq", "I think C", "C", 0.0),
            ("mcq", "B", "Paris", 0.0),  # a solution naming no letter scores 0
            ("yes_no", "Yes, it is.", "yes", 1.0),
            ("yes_no", "no", "<answer>No</answer>", 1.0),
            ("yes_no", "I don't know", "no", 0.0),
            ("yes_no", "yes", "no", 0.0),
            ("yes_no", "maybe", "perhaps", 0.0),  # VLM-R1 scores 1.0: neither says yes or no
            ("numeric", "1,000", "1000", 1.0),
            ("numeric", "3.0", "3", 1.0),
            ("numeric", "0.5", ".5", 1.0),
            ("numeric", "4", "3", 0.0),
            ("numeric", "3 apples", "3", 0.0),
            ("numeric", "abc", "abc", 0.0),  # equal, but not numbers
            ("numeric", "\\boxed{5}", "5", 1.0),  # a LaTeX wrapper is read through
            ("numeric", "\\text{1,000}", "\\boxed{1000}", 1.0),
            ("numeric", "\\boxed{5 cm}", "5", 0.0),
            ("fuzzy", "kitten", "sitting", KITTEN_SITTING),
            ("fuzzy", "New York.", "new york city", NEW_YORK_CITY),
            ("fuzzy", "Paris", "paris", 1.0),
            ("fuzzy", "...", "x", 0.0),  # nothing left after normalising
            ("default", "3.0", "3", 1.0),
            ("default", "kitten", "sitting", 0.0),  # no partial credit
            ("default", "1000", "1e3", 1.0),  # the same number
            ("default", "\\text{5 cm}", "5 cm", 1.0),  # a LaTeX wrapper is read through
            ("default", "1001", "1e3", 0.0),
            # iou: [0,0,4,4] (16) and [2,0,6,4] (16) share [2,0,4,4] (8): 8 / (16 + 16 - 8)
            ("iou", "[0,0,4,4]", "[2,0,6,4]", 1 / 3),
            ("iou", '{"bbox_2d": [2, 0, 6, 4]}', "<answer>[2,0,6,4]</answer>", 1.0),
            ("iou", "[0,0,4,4] then [2,0,6,4]", "[2,0,6,4]", 1 / 3),  # the first box counts
            ("iou", "[0,0,1,1]", "[5,5,6,6]", 0.0),  # disjoint
            ("iou", "left", "[2,0,6,4]", 0.0),  # no box
            ("iou", "[0,0,4,4]", "red", 0.0),  # the solution has no box
        ],
    )
    def test_cases(self, method: str, answer: str, solution: str, expected: float) -> None:
        assert score_by_method(method, tagged(answer), solution) == pytest.approx(expected)

    def test_math(self) -> None:
        pytest.importorskip("math_verify")
        assert score_by_method("math", tagged("\\frac{1}{2}"), "0.5") == 1.0
        assert score_by_method("math", tagged("0.5"), "<answer>$\\frac{1}{2}$</answer>") == 1.0
        assert score_by_method("math", tagged("\\frac{1}{3}"), "0.5") == 0.0
        assert score_by_method("math", tagged("x"), "x") == 1.0  # exact, though not math-like

    # One right answer per method, so the untagged case below shows the tag is what is missing.
    RIGHT = {"default": "3", "mcq": "B", "yes_no": "yes", "numeric": "1000", "math": "2",
             "fuzzy": "paris", "iou": "[1,2,3,4]"}

    @pytest.mark.parametrize("method", list(METHODS))
    def test_answer_tag_required(self, method: str) -> None:
        if method == "math":
            pytest.importorskip("math_verify")
        answer = self.RIGHT[method]
        assert score_by_method(method, tagged(answer), answer) == 1.0
        # VLM-R1 grades the whole text when there is no <answer>; r1fit scores 0.
        assert score_by_method(method, f"<think>...</think>{answer}", answer) == 0.0
        assert score_by_method(method, "<answer> </answer>", answer) == 0.0
        assert score_by_method(method, tagged(answer), "<answer></answer>") == 0.0

    def test_last_answer_wins(self) -> None:
        completion = "<answer>A</answer> wait, <answer>(b)</answer>"
        assert score_by_method("mcq", completion, "B") == 1.0
        assert score_by_method("mcq", completion, "A") == 0.0


class TestCheckMethod:
    @pytest.mark.parametrize(
        ("name", "message"),
        [
            ("MCQ", f"unknown accuracy method 'MCQ': use one of {KNOWN}"),
            ("", f"unknown accuracy method '': use one of {KNOWN}"),
            (None, f"unknown accuracy method None: use one of {KNOWN}"),
            ("map", "accuracy method 'map' (detection mAP) is not built in: use the iou reward "
                    "(rewards.iou=1.0) or a reward plugin 'package.module:function'"),
            ("llm", "accuracy method 'llm' (an LLM judge) is not built in: write the judge as a "
                    "reward plugin, rewards.\"pkg.mod:judge\"=1.0"),
        ],
    )
    def test_message(self, name: object, message: str) -> None:
        with pytest.raises(RewardConfigError) as excinfo:
            check_method(name)  # type: ignore[arg-type]
        assert str(excinfo.value) == message

    def test_known_methods_pass(self) -> None:
        pytest.importorskip("math_verify")
        for name in METHODS:
            check_method(name)

    def test_math_without_math_verify(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(methods, "_math_verify", lambda: None)
        message = ("accuracy method 'math' needs math-verify: pip install math-verify (a "
                   "dependency of r1fit; missing only in a hand-made environment)")
        with pytest.raises(RewardConfigError) as excinfo:
            check_method("math")
        assert str(excinfo.value) == message
        with pytest.raises(RewardConfigError, match="needs math-verify"):
            score_by_method("math", tagged("0.5"), "0.5")
        check_method("default")  # default falls back to exact matching instead
        assert score_by_method("default", tagged("0.5"), "0.5") == 1.0

    def test_error_kinds(self) -> None:
        # One class for the registry and the methods; data loading catches it as a ValueError
        # and the CLI prints an R1fitError as one line.
        assert registry.RewardConfigError is RewardConfigError
        assert issubclass(RewardConfigError, ValueError)
        assert issubclass(RewardConfigError, R1fitError)


class TestDispatch:
    def test_accuracy_reads_reward_method(self) -> None:
        completion = tagged("(b)")
        assert accuracy(completion, "B", problem="") == 0.0  # default: "(b)" is not "b"
        assert accuracy(completion, "B", problem="", reward_method="default") == 0.0
        assert accuracy(completion, "B", problem="", reward_method="mcq") == 1.0
        assert accuracy(tagged("kitten"), "sitting", problem="", reward_method="fuzzy") \
            == pytest.approx(KITTEN_SITTING)
        with pytest.raises(RewardConfigError, match="unknown accuracy method 'mpc'"):
            accuracy(completion, "B", problem="", reward_method="mpc")

    def test_scorer_passes_reward_method(self, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        # A plugin written before reward_method existed: it ignores the new info key.
        (tmp_path / "old_rewards_plugin.py").write_text(
            "def is_long(completion, solution, **info):\n    return float(len(completion) > 40)\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        scorer = RewardScorer({"accuracy": 1.0, "old_rewards_plugin:is_long": 0.5})
        completions = [
            tagged("(b)"),  # 38 characters: not long
            "<think>hmm</think><answer>I don't know</answer>",
            tagged("kitten"),
            tagged("3.0"),
            tagged("B"),
        ]
        solutions = ["B", "no", "sitting", "3", "B"]
        infos = [
            {"problem": "q", "reward_method": "mcq"},
            {"problem": "q", "reward_method": "yes_no"},
            {"problem": "q", "reward_method": "fuzzy"},
            {"problem": "q"},  # no method: default
            {"problem": "q", "reward_method": "nope"},  # raises inside accuracy: contained
        ]
        result = scorer.score(completions, solutions, infos)
        accuracy_scores = torch.tensor([1.0, 0.0, KITTEN_SITTING, 1.0, 0.0])
        long_scores = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0])
        torch.testing.assert_close(result.components["accuracy"], accuracy_scores)
        torch.testing.assert_close(result.components["old_rewards_plugin:is_long"], long_scores)
        torch.testing.assert_close(result.total, accuracy_scores + 0.5 * long_scores)
        assert result.errors_by_reward == {"accuracy": 1, "old_rewards_plugin:is_long": 0}
        assert "unknown accuracy method 'nope'" in (result.first_error or "")


def test_default_without_math_verify_warns_once_and_math_refuses(monkeypatch, caplog):
    from r1fit.rewards import methods

    monkeypatch.setattr(methods, "_math_verify", lambda: None)
    monkeypatch.setattr(methods, "_WARNED", [])
    with caplog.at_level("WARNING", logger="r1fit.rewards"):
        methods.check_method("default")
        methods.check_method("default")
    warned = [r.getMessage() for r in caplog.records if "math-verify is not installed" in r.message]
    assert len(warned) == 1 and "exact matches only" in warned[0]
    with pytest.raises(methods.RewardConfigError, match="'math' needs math-verify"):
        methods.check_method("math")
