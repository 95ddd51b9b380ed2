"""State dicts as safetensors + JSON: exact round trips, no pickle, atomic text replace."""

from __future__ import annotations

import json

import pytest
import torch

from r1fit.checkpoint.files import load_state, save_state, sha256_file, write_text_atomic


def test_round_trip_keeps_tensors_tuples_and_scalars_exactly(tmp_path):
    state = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 5),
                             "half": torch.randn(3).to(torch.bfloat16)}},
             "param_groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "params": ["w"],
                               "eps": 1e-8, "fused": None, "amsgrad": False}],
             "python": (3, (1, 2, 3), None)}
    files = save_state(tmp_path, "opt", state)
    assert files == ["opt.json", "opt.safetensors"]
    back = load_state(tmp_path, "opt")
    assert back["param_groups"] == state["param_groups"]  # 0.30000000000000004 survives JSON
    assert back["python"] == (3, (1, 2, 3), None) and isinstance(back["python"][1], tuple)
    for key, tensor in state["state"]["w"].items():
        assert back["state"]["w"][key].dtype == tensor.dtype
        assert torch.equal(back["state"]["w"][key], tensor)
    # the JSON is plain data with tensor references, nothing executable
    skeleton = json.loads((tmp_path / "opt.json").read_text())
    assert skeleton["state"]["w"]["step"] == {"__tensor__": "0"}


def test_no_tensor_file_when_there_are_no_tensors(tmp_path):
    assert save_state(tmp_path, "sched", {"last_epoch": 7, "base_lrs": [0.01]}) == ["sched.json"]
    assert load_state(tmp_path, "sched") == {"last_epoch": 7, "base_lrs": [0.01]}


def test_unsupported_values_are_refused(tmp_path):
    with pytest.raises(TypeError, match="cannot save a set"):
        save_state(tmp_path, "x", {"a": {1, 2}})
    with pytest.raises(TypeError, match="keys must be strings"):
        save_state(tmp_path, "x", {"state": {0: torch.zeros(1)}})


def test_write_text_atomic_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "latest"
    write_text_atomic(target, "checkpoint-1\n")
    write_text_atomic(target, "checkpoint-2\n")
    assert target.read_text() == "checkpoint-2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_sha256_file(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    assert sha256_file(tmp_path / "f") == \
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
