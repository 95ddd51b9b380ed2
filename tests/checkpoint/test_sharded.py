"""Weights and optimizer moments through torch.distributed.checkpoint, in one process (the
2-process and N->M cases run under torchrun in tests/e2e/test_distributed.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from r1fit.checkpoint.sharded import load_model_weights, model_tensors, save_tensors, saved_keys
from r1fit.checkpoint.state import OptimizerState, load_optimizer_sharded


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(3, 3)
        self.second = torch.nn.Linear(3, 1)


def trained() -> tuple[TwoLayers, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    for _ in range(2):  # only `first` gets gradients: `second` has no optimizer state
        model.first(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def test_model_weights_round_trip_exactly(tmp_path):
    model, _ = trained()
    save_tensors(tmp_path, {"model": model_tensors(model)})
    other = TwoLayers()
    load_model_weights(tmp_path, "model", other)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_weights_are_named(tmp_path):
    save_tensors(tmp_path, {"model": model_tensors(torch.nn.Linear(3, 3))})
    with pytest.raises(ValueError, match="no model weight 'first.bias'"):
        load_model_weights(tmp_path, "model", TwoLayers())


def test_optimizer_moments_resume_exactly(tmp_path):
    model, optimizer = trained()
    state = OptimizerState(model, optimizer).state_dict()
    save_tensors(tmp_path, {"optimizer": state["state"]})

    model2 = copy.deepcopy(model)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.1, weight_decay=0.01)
    load_optimizer_sharded(OptimizerState(model2, optimizer2), tmp_path, "optimizer",
                           state["param_groups"])
    # the zero-gradient initialisation step at lr 0 left the weights untouched
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert optimizer2.state[model2.second.weight] == {}  # no state saved, none made up
    first = optimizer2.state[model2.first.weight]
    assert first["step"].item() == 2.0
    assert torch.equal(first["exp_avg"], optimizer.state[model.first.weight]["exp_avg"])
    # and the next update is the same as the uninterrupted optimizer's, bit for bit
    x = torch.randn(4, 3)
    for m, opt in ((model, optimizer), (model2, optimizer2)):
        (m.first(x).pow(2).sum() + m.second(x).sum()).backward()
        opt.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_optimizer_for_other_parameters_is_refused(tmp_path):
    model, optimizer = trained()
    state = OptimizerState(model, optimizer).state_dict()
    save_tensors(tmp_path, {"optimizer": state["state"]})
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="saved for other parameters"):
        load_optimizer_sharded(OptimizerState(other, torch.optim.AdamW(other.parameters())),
                               tmp_path, "optimizer", state["param_groups"])


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tie_word_embeddings


def test_a_tied_weight_is_written_once_and_loads_under_both_names(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    save_tensors(tmp_path, {"model": model_tensors(model)})
    assert saved_keys(tmp_path) == {"model.embed.weight"}
    other = Tied()
    load_model_weights(tmp_path, "model", other)
    assert other.head.weight is other.embed.weight
    assert torch.equal(other.head.weight, model.embed.weight)
