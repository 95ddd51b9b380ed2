import pytest
import torch

from r1fit.algorithms.shaping import overlong_penalty


def test_dapo_overlong_penalty_by_hand():
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens; then (16 - |y|) / 4: 17 -> -0.25,
    # 18 -> -0.5, 20 -> -1; beyond 20 (not reachable by generation) -1. Factor 0.5 halves them.
    lengths = torch.tensor([3, 16, 17, 18, 20, 25])
    out = overlong_penalty(lengths, max_new_tokens=20, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = overlong_penalty(lengths, max_new_tokens=20, buffer=4, penalty=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    assert out.dtype == torch.float32


def test_buffer_zero_is_off_and_whole_length_buffer_is_linear():
    torch.testing.assert_close(overlong_penalty(torch.tensor([8, 1]), max_new_tokens=8, buffer=0),
                               torch.zeros(2))
    # buffer = L_max = 8: expected length 0, so -|y| / 8: 2 -> -0.25, 8 -> -1.
    torch.testing.assert_close(overlong_penalty(torch.tensor([2, 8]), max_new_tokens=8, buffer=8),
                               torch.tensor([-0.25, -1.0]))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"buffer": 9}, r"buffer must be in \[0, max_new_tokens=8\]"),
    ({"buffer": -1}, "buffer must be in"),
    ({"penalty": -1.0}, "penalty must be >= 0"),
    ({"max_new_tokens": 0, "buffer": 0}, "max_new_tokens must be >= 1"),
])
def test_bad_settings_raise_value_error(kwargs, message):
    args = {"max_new_tokens": 8, "buffer": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([1]), **args)
