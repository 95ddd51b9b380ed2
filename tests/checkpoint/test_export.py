"""`r1fit export`: checkpoints of short SFT runs on builtin:tiny (full and LoRA) as plain Hugging
Face folders."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from r1fit.cli import main

# SFT, not GRPO: its gradients are non-zero on random weights, so the weights (and the LoRA B
# matrices, which start at 0) really move and the comparisons below are not trivially true
RUN = ["sft.steps=2", "sft.batch_size=4", "checkpoint.every=2", "data.eval=null",
       "data.shapes.train_size=50", "data.shapes.image_size=56", "data.max_pixels=3136"]


@pytest.fixture(scope="module")
def checkpoints(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        assert main(["sft", f"train.output_dir={root / 'full'}", *RUN]) == 0
        assert main(["sft", f"train.output_dir={root / 'lora'}", *RUN, "model.lora.r=4",
                     "sft.learning_rate=5e-2"]) == 0
    return {"full": root / "full" / "checkpoint-2", "lora": root / "lora" / "checkpoint-2"}


def export(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["export", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fixed_inputs(processor) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    return processor(text=[text + "<answer>red</answer>"], images=[image], return_tensors="pt")


def test_full_finetuning_export_is_byte_identical(checkpoints, capsys, tmp_path):
    """The consolidated shards equal the weights the run ended with (checkpoint-2 is its last
    step, and ``final/`` is written from the live model)."""
    out = tmp_path / "exported"
    out.mkdir()  # an empty folder is fine
    code, stdout, _ = export(capsys, str(checkpoints["full"]), str(out))
    assert code == 0 and "full fine-tuned weights" in stdout
    assert not (tmp_path / "exported.partial").exists()
    exported = AutoModelForImageTextToText.from_pretrained(out)
    AutoProcessor.from_pretrained(out)
    trained = AutoModelForImageTextToText.from_pretrained(checkpoints["full"].parent / "final")
    got, want = exported.state_dict(), trained.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_lora_adapter_export_names_its_base(checkpoints, capsys, tmp_path, use_tiny_cache):
    out = tmp_path / "adapter"
    code, stdout, _ = export(capsys, str(checkpoints["lora"]), str(out))
    assert code == 0
    assert "it needs its base model" in stdout and str(use_tiny_cache / "models") in stdout
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    AutoProcessor.from_pretrained(out)
    model = AutoModelForImageTextToText.from_pretrained(out)  # transformers' peft integration
    assert getattr(model, "_hf_peft_config_loaded", False)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_merged_lora_export_matches_the_peft_model(checkpoints, capsys, tmp_path, use_tiny_cache):
    out = tmp_path / "merged"
    code, stdout, _ = export(capsys, str(checkpoints["lora"]), str(out), "--merge-lora")
    assert code == 0 and "LoRA merged into builtin:tiny" in stdout
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    base = AutoModelForImageTextToText.from_pretrained(next((use_tiny_cache / "models")
                                                            .glob("tiny-v*"))).eval()
    inputs = fixed_inputs(processor)
    with torch.no_grad():
        base_logits = base(**inputs).logits
        peft = PeftModel.from_pretrained(base, str(checkpoints["lora"].parent / "final")).eval()
        peft_logits = peft(**inputs).logits
        merged_logits = merged(**inputs).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapter changes the model
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=0)


def test_refuses_a_non_empty_out(checkpoints, capsys, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = export(capsys, str(checkpoints["full"]), str(out))
    assert code == 2
    assert err == f"r1fit: error: {out} already exists and is not empty; export into a new folder\n"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "taken.partial").exists()
    code, _, err = export(capsys, str(checkpoints["full"]), str(out / "notes.txt"))
    assert (code, err) == (2, f"r1fit: error: {out / 'notes.txt'} already exists and is a file; "
                              "export into a new folder\n")


def test_export_into_the_current_folder_fills_it(checkpoints, capsys, tmp_path, monkeypatch):
    """OUT "." (an empty current folder): its files land in it and the folder itself stays (the
    shell's working folder); it failed with "Invalid argument (.)"."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, stdout, _ = export(capsys, str(checkpoints["full"]), ".")
    assert code == 0 and "to . (" in stdout
    assert (here / "model.safetensors").is_file() and (here / "config.json").is_file()
    assert not (tmp_path / "here.partial").exists()


def test_a_full_disk_while_writing_is_one_line(checkpoints, capsys, tmp_path, monkeypatch):
    """safetensors reports ENOSPC as its own SafetensorError, which escaped as a traceback."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full_disk(self, *args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "out"
    code, _, err = export(capsys, str(checkpoints["full"]), str(out))
    assert code == 2
    assert err == (f"r1fit: error: could not export to {out}: Error while serializing: I/O error: "
                   "No space left on device (os error 28)\n")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_a_full_disk_while_the_tokenizer_writes_is_one_line(checkpoints, capsys, tmp_path,
                                                             monkeypatch):
    """The tokenizers library reports ENOSPC as a bare Exception ending in '(os error 28)'."""
    from transformers import ProcessorMixin

    def full_disk(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")  # noqa: TRY002 -- as tokenizers

    monkeypatch.setattr(ProcessorMixin, "save_pretrained", full_disk)
    out = tmp_path / "out"
    code, _, err = export(capsys, str(checkpoints["full"]), str(out))
    # the weights were written first (their progress bar is on stderr too)
    assert (code, err.splitlines()[-1]) == (2, f"r1fit: error: could not export to {out}: No "
                                               "space left on device (os error 28)")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_or_missing_checkpoint_is_a_one_line_error(checkpoints, capsys, tmp_path):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(checkpoints["full"], ckpt)
    weights = next((ckpt / "weights").glob("*.distcp"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, _, err = export(capsys, str(ckpt), str(tmp_path / "out"))
    assert code == 2
    assert err == (f"r1fit: error: {ckpt}: cannot export: weights/{weights.name} does not match "
                   "its sha256 in the manifest (corrupt)\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

    code, _, err = export(capsys, str(tmp_path / "nope"), str(tmp_path / "out"))
    assert code == 2 and err == f"r1fit: error: {tmp_path / 'nope'}: no such checkpoint folder\n"


@pytest.mark.parametrize("merge", [[], ["--merge-lora"]], ids=["adapter", "merged"])
def test_a_truncated_base_model_is_a_one_line_error(checkpoints, capsys, tmp_path, tiny_cache,
                                                    monkeypatch, merge):
    tiny = next((tiny_cache / "models").glob("tiny-v*"))
    base = tmp_path / "cache" / "models" / tiny.name  # builtin:tiny, its weights cut in half
    shutil.copytree(tiny, base)
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path / "cache"))
    code, _, err = export(capsys, str(checkpoints["lora"]), str(tmp_path / "out"), *merge)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"r1fit: error: {checkpoints['lora']}: cannot rebuild the LoRA model on "
                          f"its base model: cannot load model 'builtin:tiny': {weights} is "
                          "truncated or corrupt (")
    assert err.endswith(f"; delete {base} and r1fit builds it again\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_final_folder_is_refused_saying_it_loads_as_it_is(checkpoints, capsys, tmp_path):
    """A run's final/ (or an export) is already a Hugging Face folder: one line says so."""
    lora_final = checkpoints["lora"].parent / "final"
    code, _, err = export(capsys, str(lora_final), str(tmp_path / "out"), "--merge-lora")
    assert code == 2
    assert err == (f"r1fit: error: {lora_final} is a LoRA adapter folder (a LoRA run's final/), "
                   "not a checkpoint: from_pretrained loads it as it is; to merge it, export the "
                   "run's last checkpoint with --merge-lora, or merge it with peft "
                   "(docs/using.md)\n")
    full_final = checkpoints["full"].parent / "final"
    code, _, err = export(capsys, str(full_final), str(tmp_path / "out"))
    assert code == 2
    assert err == (f"r1fit: error: {full_final} is a Hugging Face model folder (a full run's "
                   "final/ or an export), not a checkpoint: from_pretrained loads it as it is\n")
    assert not (tmp_path / "out").exists()


def test_a_runs_final_folder_is_written_whole_or_not_at_all(tmp_path):
    """save_hf_folder (a run's final/) through a partial folder: a full disk midway is one line
    and leaves neither a final/ with its configs only nor the partial folder; a later success
    replaces an earlier final/."""
    from types import SimpleNamespace

    from safetensors import SafetensorError

    from r1fit.checkpoint.export import save_hf_folder
    from r1fit.checkpoint.manager import CheckpointError

    def configs_then_full_disk(folder, state_dict=None):
        (Path(folder) / "config.json").write_text("{}")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    def writes(folder, state_dict=None):
        (Path(folder) / "model.safetensors").write_text("w")

    processor = SimpleNamespace(save_pretrained=lambda folder: None)
    final = tmp_path / "final"
    with pytest.raises(CheckpointError, match=re.escape(
            f"could not write {final}: Error while serializing: I/O error: No space left on "
            "device. The checkpoints are intact")):
        save_hf_folder(SimpleNamespace(save_pretrained=configs_then_full_disk), processor, final)
    assert list(tmp_path.iterdir()) == []

    def tokenizer_full(folder):
        raise Exception("No space left on device (os error 28)")  # noqa: TRY002 -- as tokenizers

    with pytest.raises(CheckpointError, match=re.escape(
            f"could not write {final}: No space left on device (os error 28). The checkpoints")):
        save_hf_folder(SimpleNamespace(save_pretrained=writes),
                       SimpleNamespace(save_pretrained=tokenizer_full), final)
    assert list(tmp_path.iterdir()) == []
    final.mkdir()
    (final / "stale.txt").write_text("an earlier final/")
    save_hf_folder(SimpleNamespace(save_pretrained=writes), processor, final)
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]
