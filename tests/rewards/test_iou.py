"""IoU rewards (r1fit/rewards/iou.py), checked on boxes worked out by hand."""

import pytest

from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.iou import answers_iou, box_iou, iou, iou_hit, parse_box


def answer(box: str) -> str:
    return f"<think>the cat is top-left</think><answer>{box}</answer>"


class TestParseBox:
    def test_ints_floats_spaces(self) -> None:
        assert parse_box("[0,0,2,2]") == (0.0, 0.0, 2.0, 2.0)
        assert parse_box("box: [ 1.5 , 2 ,3.25,  4 ] and [9,9,10,10]") == (1.5, 2.0, 3.25, 4.0)
        assert parse_box('{"bbox_2d": [10, 20, 30, 40], "label": "cat"}') == (10, 20, 30, 40)

    def test_unparsable_or_degenerate(self) -> None:
        assert parse_box("no box here") is None
        assert parse_box("[1, 2, 3]") is None
        assert parse_box("[a, b, c, d]") is None
        assert parse_box("[2, 0, 2, 5]") is None  # zero width
        assert parse_box("[0, 5, 3, 1]") is None  # y2 < y1


class TestIoU:
    def test_hand_computed_overlap(self) -> None:
        # Intersection [1,1,2,2] has area 1; union = 4 + 4 - 1 = 7.
        assert iou(answer("[0,0,2,2]"), "[1,1,3,3]", problem="") == pytest.approx(1 / 7)
        assert box_iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)

    def test_contained_box(self) -> None:
        # [0,0,4,4] (16) contains [0,0,2,4] (8): IoU = 8/16.
        assert iou(answer("[0, 0, 2, 4]"), "<answer>[0, 0, 4, 4]</answer>", problem="") == 0.5

    def test_identical_and_disjoint(self) -> None:
        assert iou(answer("[10.0, 20.0, 30.0, 40.0]"), "[10,20,30,40]", problem="") == 1.0
        assert iou(answer("[0,0,1,1]"), "[2,2,3,3]", problem="") == 0.0
        assert iou(answer("[0,0,1,1]"), "[1,0,2,1]", problem="") == 0.0  # touching edges

    def test_zero_when_unparsable(self) -> None:
        assert iou("[0,0,2,2]", "[0,0,2,2]", problem="") == 0.0  # no <answer> tag
        assert iou(answer("top left"), "[0,0,2,2]", problem="") == 0.0
        assert iou(answer("[0,0,2,2]"), "somewhere", problem="") == 0.0
        assert iou(answer("[0,0,0,2]"), "[0,0,2,2]", problem="") == 0.0


class TestIoUHit:
    def test_threshold(self) -> None:
        assert iou_hit(answer("[0, 0, 2, 4]"), "[0, 0, 4, 4]", problem="") == 1.0  # exactly 0.5
        # [0,0,4,4] vs [0,0,4,3.9]: IoU 0.975 -> hit; vs [1,1,3,3]: IoU 4/16 -> miss.
        assert iou_hit(answer("[0,0,4,3.9]"), "[0,0,4,4]", problem="") == 1.0
        assert iou_hit(answer("[1,1,3,3]"), "[0,0,4,4]", problem="") == 0.0
        assert iou_hit(answer("none"), "[0,0,4,4]", problem="") == 0.0


class TestIoUAccuracyMethod:
    def test_answers_iou(self) -> None:
        # [0,0,3,2] (6) and [1,0,4,2] (6) share [1,0,3,2] (4): 4 / (6 + 6 - 4) = 0.5
        assert answers_iou("[0,0,3,2]", "[1,0,4,2]") == 0.5
        assert answers_iou("none", "[1,0,4,2]") == 0.0
        assert answers_iou("[1,0,4,2]", "") == 0.0

    @pytest.mark.parametrize("completion", [
        answer("[0,0,3,2]"), answer("[1, 0, 4, 2]"), answer("[5,5,6,6]"), answer("no box"),
        "[1,0,4,2] without a tag", "<answer>[9,9,9,9]</answer> <answer>[0,0,3,2]</answer>"])
    def test_accuracy_method_is_the_iou_reward(self, completion: str) -> None:
        # rows of builtin:shapes box questions carry reward_method "iou": their logged accuracy
        # (and eval/accuracy) is the same IoU the reward gives
        solution = "[1,0,4,2]"
        assert accuracy(completion, solution, problem="", reward_method="iou") == \
            iou(completion, solution, problem="")
