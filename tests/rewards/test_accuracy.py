"""Accuracy reward (its default method) and the answer helpers it is built on
(r1fit/rewards/accuracy.py, methods.py, answer.py); the other methods are in test_methods.py."""

import threading

import pytest

from r1fit.rewards import methods
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.answer import extract_answer, normalize
from r1fit.rewards.methods import math_equivalent

COMPLETION_3 = "<think>1 + 2 = 3</think><answer> 3 </answer>"


class TestExtractAnswer:
    def test_last_answer_wins_and_is_stripped(self) -> None:
        text = "<answer>1</answer> wait, no <answer>\n 2 \n</answer>"
        assert extract_answer(text) == "2"

    def test_multiline_answer(self) -> None:
        assert extract_answer("<answer>a\nb</answer>") == "a\nb"

    def test_no_tag_is_none_for_completions(self) -> None:
        assert extract_answer("the answer is 3") is None
        assert extract_answer("<answer>3") is None  # unclosed

    def test_untagged_solution_is_whole_text(self) -> None:
        assert extract_answer("  3 \n", untagged_is_answer=True) == "3"
        assert extract_answer("<answer> 4 </answer>", untagged_is_answer=True) == "4"

    def test_an_untagged_solution_after_its_thinking_is_the_text_after_it(self) -> None:
        # DeepSeek-R1's layout: the gold answer is what follows </think>, not the thinking too
        assert extract_answer("\n<think>two red\ncircles</think>\n\n2 ", untagged_is_answer=True) == "2"
        assert extract_answer("<think>a</think>", untagged_is_answer=True) == ""  # nothing after
        # a think block later in the text is not an opening one: the whole text stands
        assert extract_answer("2 <think>a</think>", untagged_is_answer=True) == "2 <think>a</think>"
        assert accuracy("<answer>2</answer>", "<think>count them</think>2", problem="") == 1.0


class TestNormalize:
    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            ("Red.", "red"),
            ('  "Red"  ', "red"),
            ("'blue'!", "blue"),
            ("New   York\n City", "new york city"),
            ("3.0", "3"),
            ("1,000", "1000"),
            ("1,000.50", "1000.5"),
            ("-0.0", "0"),
            ("-2.50", "-2.5"),
            (".5", "0.5"),
            ("$42$", "42"),
            ("three", "3"),
            ("Twenty", "20"),
            ("zero", "0"),
            ("3 apples.", "3 apples"),
            ("three apples", "3 apples"),
            ("twenty-one", "twenty-one"),  # only zero..twenty are spelled-out numbers
            ("1,5", "1,5"),  # not a thousands group: left alone rather than guessed
            ("", ""),
        ],
    )
    def test_cases(self, raw: str, expected: str) -> None:
        assert normalize(raw) == expected


class TestAccuracy:
    def test_tagged_and_bare_solution(self) -> None:
        assert accuracy(COMPLETION_3, "<answer>3</answer>", problem="1+2?") == 1.0
        assert accuracy(COMPLETION_3, "3", problem="1+2?") == 1.0

    def test_case_and_punctuation(self) -> None:
        assert accuracy("<think>.</think><answer>Red.</answer>", "red", problem="") == 1.0

    def test_number_word(self) -> None:
        assert accuracy("<think>.</think><answer>three</answer>", "3", problem="") == 1.0

    def test_number_formats(self) -> None:
        assert accuracy("<answer>3.0</answer>", "3", problem="") == 1.0
        assert accuracy("<answer>1,000</answer>", "1000", problem="") == 1.0

    def test_wrong_answer(self) -> None:
        assert accuracy("<think>.</think><answer>4</answer>", "3", problem="") == 0.0
        assert accuracy("<answer>blue</answer>", "red", problem="") == 0.0

    def test_missing_tag(self) -> None:
        assert accuracy("<think>it is 3</think> 3", "3", problem="") == 0.0

    def test_empty_answer(self) -> None:
        assert accuracy("<answer>  </answer>", "", problem="") == 0.0

    def test_last_answer_is_graded(self) -> None:
        assert accuracy("<answer>3</answer><answer>4</answer>", "4", problem="") == 1.0
        assert accuracy("<answer>3</answer><answer>4</answer>", "3", problem="") == 0.0


class TestMathEquivalence:
    def test_fraction_equals_decimal(self) -> None:
        pytest.importorskip("math_verify")
        assert accuracy("<think>.</think><answer>\\frac{1}{2}</answer>", "0.5", problem="") == 1.0
        assert accuracy("<answer>0.5</answer>", "$\\frac{1}{2}$", problem="") == 1.0

    def test_symbolic_equivalence_and_inequivalence(self) -> None:
        pytest.importorskip("math_verify")
        assert math_equivalent("(x+1)^2", "x^2+2x+1")
        assert not math_equivalent("(x+1)^2", "x^2+1")
        assert accuracy("<answer>\\frac{1}{3}</answer>", "0.5", problem="") == 0.0

    @pytest.mark.parametrize(("prediction", "gold", "expected"), [
        ("10 cm", "10 m", 0.0),  # math-verify drops units: both read 10
        ("10\\text{ kg}", "10\\text{ cm}", 0.0),
        ("10", "10 m", 1.0),  # a unit left out is still the number
        ("10 m", "10", 1.0),
        ("x = 3", "3", 1.0),
        ("y = 3", "x = 3", 0.0),
        ("2, 1", "1, 2", 0.0),  # wrapped in $..$, math-verify read both as the set {1, 2}
        ("1,2", "1, 2", 1.0),
        ("1, 2, 3", "1, 2", 0.0),
        ("0.50, 3", "1/2; 3", 1.0),  # each item by math-verify, in order
        ("2 1", "1 2", 0.0),
        ("1,000", "1000", 1.0),  # a thousands separator is no list
        ("\\{2, 1\\}", "\\{1, 2\\}", 1.0),  # a set written as one stays one
        ("(2, 1)", "(1, 2)", 0.0),
    ])
    def test_units_and_plain_lists_must_match(self, prediction: str, gold: str,
                                              expected: float) -> None:
        pytest.importorskip("math_verify")
        assert accuracy(f"<answer>{prediction}</answer>", gold, problem="") == expected

    def test_plain_words_never_reach_the_symbolic_check(self) -> None:
        # As symbols, r*e*d == d*e*r; words must be compared as text only.
        pytest.importorskip("math_verify")
        assert not math_equivalent("red", "der")
        assert accuracy("<answer>der</answer>", "red", problem="") == 0.0

    def test_works_off_the_main_thread(self) -> None:
        # math-verify's signal-based timeout raises ValueError outside the main thread unless
        # disabled; the reward must still give the right answer there.
        pytest.importorskip("math_verify")
        results: list[float] = []
        def run() -> None:
            results.append(accuracy("<answer>\\frac{1}{2}</answer>", "0.5", problem=""))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=30)
        assert results == [1.0]


def test_without_math_verify_only_exact_matches_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    # A None entry in sys.modules makes `import math_verify` raise ImportError.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    methods._math_verify.cache_clear()
    try:
        assert accuracy("<answer>\\frac{1}{2}</answer>", "0.5", problem="") == 0.0
        assert accuracy("<answer>0.50</answer>", "0.5", problem="") == 1.0
    finally:
        monkeypatch.undo()
        methods._math_verify.cache_clear()
