"""``full_named_weights``: the policy's whole weights under the transformers model's names, as the
vLLM engine takes them, checked without vLLM.

One process: LoRA layers give peft's own ``merge_and_unload()`` weights, every name of the
transformers model is there (the tied LM head too) and the trainable adapters are left alone.
Two processes (gloo, FSDP2 through r1fit's own loading and ``parallelize``): every rank gets the
one-process weights bit for bit. This file is also the script the two processes run
(``python -m torch.distributed.run ... tests/models/test_weights.py <model folder> <out>``).
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from r1fit.distributed.loading import load_on_ranks
from r1fit.models.load import load_policy, unwrap
from r1fit.models.weights import full_named_weights, weight_bytes
from r1fit.processes import close_distributed, init_distributed

LOAD = dict(lora_alpha=16, lora_dropout=0.0, lora_target="all-linear", freeze_vision=False,
            dtype="float32", gradient_checkpointing=False)
LORA_RS = (0, 4)  # full fine-tuning, LoRA
TIED = ("model.language_model.embed_tokens.weight", "lm_head.weight")
REPO = Path(__file__).resolve().parents[2]


def build(folder: Path | str, lora_r: int, device: torch.device | str):
    """builtin:tiny from ``folder``; under LoRA every adapter matrix is drawn from a fixed seed:
    peft starts B at zero (the merge would add nothing) and draws A from the global RNG (it
    would differ between processes). The meta skeleton (ranks but 0) gets its values from rank 0.
    """
    model, processor = load_policy(str(folder), lora_r=lora_r, device=device, **LOAD)
    if str(device) != "meta":
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_" in name:
                    param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model, processor


def test_lora_weights_are_peft_merge_and_the_adapters_stay(tiny_dir):
    model, _ = build(tiny_dir, 4, "cpu")
    base = unwrap(model)  # the transformers model, LoRA layers in place of its projections
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in base.named_parameters()}
    expected = dict(copy.deepcopy(model).merge_and_unload().named_parameters(remove_duplicate=False))
    plain, _ = build(tiny_dir, 0, "cpu")

    pairs = list(full_named_weights(model))
    names = [n for n, _ in pairs]
    # every name of the transformers model once, in its order, the tied LM head included
    assert names == list(expected) == [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert base.lm_head.weight is base.model.language_model.embed_tokens.weight  # tiny ties them
    assert "lm_head.weight" not in dict(base.named_parameters())  # so only remove_duplicate=False has it
    full = dict(pairs)
    torch.testing.assert_close(full[TIED[0]], full[TIED[1]], rtol=0, atol=0)

    merged = sorted({n.split(".base_layer.")[0] + ".weight" for n in before if ".base_layer.weight" in n})
    assert len(merged) == 7 * base.config.text_config.num_hidden_layers  # every projection adapted
    for name in names:
        assert not full[name].requires_grad, name
        # peft's merge is the same float32 arithmetic, W + (B @ A) * scale, in the same order on
        # the same process: bit for bit (measured), kept so while peft computes it that way
        torch.testing.assert_close(full[name], expected[name], rtol=0, atol=0, msg=name)
    for name in merged:  # the adapters matter: the merge moved every adapted weight
        base_weight = before[name.removesuffix("weight") + "base_layer.weight"][0]
        assert (full[name] - base_weight).abs().max() > 0.1, name

    # base weights are not merged in place, adapters keep their values and stay trainable
    after = dict(base.named_parameters())
    assert after.keys() == before.keys()
    for name, (value, requires_grad) in before.items():
        assert torch.equal(after[name], value), name
        assert after[name].requires_grad == requires_grad == (".lora_" in name), name


def test_full_weights_are_the_state_dict(tiny_dir):
    model, _ = build(tiny_dir, 0, "cpu")
    state = model.state_dict()
    pairs = list(full_named_weights(model))
    assert [n for n, _ in pairs] == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert set(TIED) <= {n for n, _ in pairs}
    assert len(pairs) == len(state)  # tiny has no persistent buffers: the state dict is the parameters
    for name, tensor in pairs:
        assert torch.equal(tensor, state[name]) and tensor.dtype == state[name].dtype, name
        assert not tensor.requires_grad, name


def test_weight_bytes_are_the_models_own_without_adapters(tiny_dir):
    """What a copy loaded from the folder holds (the vLLM engine's): every weight once, the tied
    LM head once, LoRA's adapters not at all; the safetensors file's tensors sum the same."""
    from safetensors import safe_open

    plain, _ = build(tiny_dir, 0, "cpu")
    lora, _ = build(tiny_dir, 4, "cpu")
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as handle:
        stored = sum(handle.get_tensor(k).numel() * 4 for k in handle.keys()
                     if k != TIED[1])  # a file may hold the tied head too
    assert weight_bytes(plain) == weight_bytes(lora) == stored
    assert weight_bytes(plain) == 4 * sum(p.numel() for p in plain.parameters())


def on_two_ranks(folder: Path, out: Path) -> None:
    """Each rank: load like a run does (rank 0 reads, every rank shards and receives its shards),
    then save its ``full_named_weights``, once with every parameter sharded (after a training
    step) and once with the root's parameters gathered (FSDP keeps them so after a no-grad
    forward: the root does not reshard until a backward)."""
    w = init_distributed("cpu")
    try:
        for lora_r in LORA_RS:
            model, _, root = load_on_ranks(functools.partial(build, folder, lora_r),
                                           torch.device("cpu"), activation_checkpointing=False)
            sharded = all(isinstance(p, DTensor) for p in model.parameters())
            weights = list(full_named_weights(model))
            root.unshard()
            root_gathered = not isinstance(unwrap(model).lm_head.weight, DTensor)
            # cloned: the gathered parameters are views of FSDP's buffer, freed by the reshard
            mixed = [(n, t.clone()) for n, t in full_named_weights(model)]
            root.reshard()
            torch.save({"sharded": sharded, "root_gathered": root_gathered, "weights": weights,
                        "mixed": mixed}, out / f"lora{lora_r}-rank{w.rank}.pt")
    finally:
        close_distributed()


@pytest.fixture(scope="module")
def two_ranks(tiny_dir, tmp_path_factory) -> Path:
    """What :func:`on_two_ranks` saved, run under torchrun (a free port of its own choice)."""
    out = tmp_path_factory.mktemp("weights")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, str(tiny_dir), str(out)]
    # its own session, so that a hang kills torchrun and both ranks, not torchrun alone
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"2 ranks still running after 180 s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.parametrize("lora_r", LORA_RS, ids=["full", "lora"])
def test_every_rank_gets_the_one_process_weights(two_ranks, tiny_dir, lora_r):
    one = list(full_named_weights(build(tiny_dir, lora_r, "cpu")[0]))
    for rank in range(2):
        saved = torch.load(two_ranks / f"lora{lora_r}-rank{rank}.pt", weights_only=True)
        assert saved["sharded"] and saved["root_gathered"], rank  # FSDP was on, the root gathered
        for got in (saved["weights"], saved["mixed"]):
            assert [n for n, _ in got] == [n for n, _ in one], rank
            for (name, expected), (_, tensor) in zip(one, got):
                same = tensor.dtype == expected.dtype and torch.equal(tensor, expected)
                assert same, (rank, name)


if __name__ == "__main__":
    on_two_ranks(Path(sys.argv[1]), Path(sys.argv[2]))
