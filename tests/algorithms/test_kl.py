import math

import pytest
import torch

from r1fit.algorithms.kl import kl_k1, kl_k3, sequence_kl_k1


def test_k3_hand_computed():
    # logp = log 0.5, ref = log 0.25: d = ref - logp = log 0.5 = -0.693147,
    # k3 = e^d - d - 1 = 0.5 + 0.693147 - 1 = 0.193147.
    k3 = kl_k3(torch.tensor([math.log(0.5)], dtype=torch.float64), torch.tensor([math.log(0.25)], dtype=torch.float64))
    assert k3.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-12)
    assert k3.item() == pytest.approx(0.193147, abs=1e-6)


def test_k3_reverse_direction():
    # logp = log 0.25, ref = log 0.5: d = log 2 = 0.693147, k3 = 2 - 0.693147 - 1 = 0.306853.
    k3 = kl_k3(torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)]))
    assert k3.item() == pytest.approx(0.306853, abs=1e-6)


def test_k3_zero_when_equal_and_never_negative():
    logp = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(kl_k3(logp, logp), torch.zeros(1000, dtype=torch.float64))
    assert (kl_k3(logp, torch.randn(1000, dtype=torch.float64)) >= 0).all()


def test_k3_precise_for_tiny_differences():
    # d = 1e-8: k3 = d^2 / 2 + O(d^3) = 5e-17, below float64's resolution around 1 (2.2e-16), so the
    # naive exp(d) - d - 1 would return rounding noise; expm1(d) - d keeps it.
    k3 = kl_k3(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1e-8], dtype=torch.float64))
    assert k3.item() == pytest.approx(5e-17, rel=1e-6)


def test_k3_gradient_flows_to_logp():
    # d k3 / d logp = -e^d + 1; at logp = log 0.5, ref = log 0.25: 1 - 0.5 = 0.5.
    logp = torch.tensor(math.log(0.5), dtype=torch.float64, requires_grad=True)
    kl_k3(logp, torch.tensor(math.log(0.25), dtype=torch.float64)).backward()
    assert logp.grad.item() == pytest.approx(0.5, abs=1e-12)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_logp shape"):
        kl_k3(torch.zeros(2, 3), torch.zeros(3))


def test_k1_and_its_sequence_sum_by_hand():
    # k1 = logp - ref: log 0.5 - log 0.25 = ln 2 = 0.693147; log 0.25 - log 0.5 = -ln 2 (k1 can be < 0).
    logp = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), 123.0]], dtype=torch.float64)
    torch.testing.assert_close(kl_k1(logp[:, :2], ref[:, :2]),
                               torch.tensor([[math.log(2), -math.log(2)]], dtype=torch.float64))
    # The sequence sum over its two valid tokens is ln 2 - ln 2 = 0; the padded third never counts.
    assert sequence_kl_k1(logp, ref, torch.tensor([[1, 1, 0]])).item() == pytest.approx(0.0, abs=1e-12)
    assert sequence_kl_k1(logp, ref, torch.tensor([[1, 0, 0]])).item() == pytest.approx(math.log(2), abs=1e-12)
