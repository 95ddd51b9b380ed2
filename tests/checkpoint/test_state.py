"""RNG and optimizer adapters: restoring a state reproduces what would have come next."""

from __future__ import annotations

import random

import pytest
import torch

from r1fit.checkpoint.files import load_state, save_state
from r1fit.checkpoint.state import Counters, OptimizerState, PythonRandomState


def test_python_random_instance(tmp_path):
    rng = random.Random(5)
    rng.random()
    save_state(tmp_path, "r", PythonRandomState(rng).state_dict())
    expected = [rng.random() for _ in range(3)]
    other = random.Random(0)
    PythonRandomState(other).load_state_dict(load_state(tmp_path, "r"))
    assert [other.random() for _ in range(3)] == expected


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 3)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_optimizer_state_is_keyed_by_name_and_continues_exactly(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer)
    saved = OptimizerState(model, optimizer).state_dict()
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    save_state(tmp_path, "optimizer", saved)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    other, other_opt = _model_and_optimizer(1)
    other.load_state_dict(params)
    OptimizerState(other, other_opt).load_state_dict(load_state(tmp_path, "optimizer"))
    _step(other, other_opt)
    for key, value in other.state_dict().items():
        assert torch.equal(value, expected[key])


def test_optimizer_state_for_other_parameters_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _step(model, optimizer)
    saved = OptimizerState(model, optimizer).state_dict()
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"saved for other parameters \(4 saved, 6 now"):
        OptimizerState(bigger, torch.optim.AdamW(bigger.parameters())).load_state_dict(saved)


def test_counters():
    counters = Counters(best=-1.0, since_best=0)
    counters.load_state_dict({"best": 0.5, "since_best": 2})
    assert (counters.best, counters.since_best) == (0.5, 2)
    with pytest.raises(ValueError, match="unknown loop counters"):
        counters.load_state_dict({"nope": 1})
