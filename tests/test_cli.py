import json
from pathlib import Path

import pytest

from r1fit.cli import main
from r1fit.config import load_config


def test_config_json_prints_resolved_values(capsys):
    assert main(["config", "--json", "algo.num_generations=4", "model.lora.r=8"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["algo"]["num_generations"] == 4 and cfg["model"]["lora"]["r"] == 8


def test_config_shows_each_value_and_its_source(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  num_generations: 4\n")
    assert main(["config", str(path), "model.lora.r=8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# preset: demo (model.path is a built-in random-weight model)")
    rows = {line.split()[0]: line.split(maxsplit=2)[1:] for line in lines[1:]}
    assert rows["algo.num_generations"] == ["4", f"file {path}"]
    assert rows["model.lora.r"] == ["8", "override"]
    assert rows["train.learning_rate"] == ["0.003", "preset demo"]
    assert rows["algo.epsilon"] == ["0.2", "default"]


def test_config_reference_lists_every_key(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "| `memory.micro_batch` |" in out and "| `algo.beta` |" in out


@pytest.mark.parametrize("argv", [["config", "--json", "--reference"],
                                  ["doctor", "--calibrate", "--check"]])
def test_flags_that_exclude_each_other_are_refused(argv, capsys):
    # each pair did one of the two silently
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_missing_config_file_is_one_line(capsys, tmp_path):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("r1fit: error: config file not found") and "\n" not in err


def _config_only_model(folder):
    """A folder holding only a small Qwen2.5-VL config.json (what `r1fit plan` needs)."""
    from transformers import Qwen2_5_VLConfig

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rope_parameters": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                "rope_theta": 1e6}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": 32}
    Qwen2_5_VLConfig(text_config=text, vision_config=vision).save_pretrained(folder)
    return folder


def test_plan_json_has_the_breakdown(capsys, tmp_path):
    folder = _config_only_model(tmp_path / "model")
    assert main(["plan", f"model.path={folder}", "algo.num_generations=4", "--json",
                 "--device-memory", "2GiB"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("parts", "peak_bytes", "budget_bytes", "fits", "max_micro_batch",
                "max_generation_batch", "advice", "phases", "activations_by_checkpointing",
                "faster"):
        assert key in plan
    # the faster configurations that fit: each its values, predicted step, speed-up and peak
    # (here 128 rows at the defaults' micro_batch 16 and generation_batch 64 on 2 GiB)
    assert plan["faster"] and all(x["speedup"] >= 1.05 and x["peak_bytes"] <= plan["usable_bytes"]
               and x["step_seconds"] > 0 and x["values"] for x in plan["faster"])
    assert set(plan["parts"]) >= {"weights", "gradients", "optimizer", "reference", "activations",
                                  "logits_chunk", "generation", "vision", "overhead"}
    assert plan["budget_bytes"] == 2 << 30 and plan["fits"] is True
    assert plan["peak_bytes"] == max(plan["phases"].values())


def test_plan_prints_a_table(capsys, tmp_path):
    folder = _config_only_model(tmp_path / "model")
    assert main(["plan", f"model.path={folder}", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "optimizer (AdamW)" in out and "of 80.00 GiB" in out
    assert "largest memory.micro_batch that fits" in out and "FSDP over 2 GPUs" in out
    assert "micro_batch_tokens" not in out  # rows unless packing is asked for


def test_plan_sft_plans_an_sft_step(capsys, tmp_path):
    folder = _config_only_model(tmp_path / "model")
    assert main(["plan", f"model.path={folder}", "--sft", "sft.batch_size=12",
                 "sft.max_answer_tokens=300"]) == 0
    out = capsys.readouterr().out
    assert "r1fit sft: 12 rows per step (sft.batch_size)" in out
    assert "answer up to 300 (sft.max_answer_tokens)" in out
    assert main(["plan", f"model.path={folder}", "--sft", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["details"]["kind"] == "sft"


def test_plan_of_packed_micro_batches_speaks_tokens(capsys, tmp_path):
    folder = _config_only_model(tmp_path / "model")
    assert main(["plan", f"model.path={folder}", "memory.micro_batch_tokens=auto",
                 "--device-memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "largest memory.micro_batch_tokens that fits" in x)
    tokens = int(line.rsplit(" ", 1)[1])
    assert f"packed by memory.micro_batch_tokens={tokens} (auto)" in out and tokens > 0


def test_plan_bad_device_memory_is_one_line(capsys):
    assert main(["plan", "--device-memory", "80 parsecs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("r1fit: error: --device-memory:") and "\n" not in err
    # a number alone is bytes: under 1 MiB a forgotten unit, as memory.budget refuses it
    assert main(["plan", "--device-memory", "80"]) == 2
    assert capsys.readouterr().err.strip() == ("r1fit: error: --device-memory: 80 is 80 bytes; "
                                               "give a unit, e.g. 80GiB")


def test_plan_with_tools_says_its_turns_and_times_a_runs_turns(capsys, use_tiny_cache):
    tools = ["tools=[zoom]", "data.max_images=2", "rollout.max_turns=3", "train.device=cpu"]
    assert main(["plan", *tools]) == 0
    assert "with tools: a trajectory of " in capsys.readouterr().out
    assert main(["plan", *tools, "--turns", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "with tools: a trajectory of 1.5 policy turns" in out
    assert "each later turn prefilling the whole context" in out  # hf on a CPU
    assert main(["plan", *tools, "--turns", "4"]) == 2
    assert capsys.readouterr().err.strip() == ("r1fit: error: --turns: got 4, expected a number "
                                               "from 1 to rollout.max_turns (3)")


def _truncated_model(tiny_dir, folder):
    """builtin:tiny with its weights file cut in half."""
    import os
    import shutil

    shutil.copytree(tiny_dir, folder)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return folder


def test_train_on_truncated_weights_is_one_line(capsys, tmp_path, tiny_dir):
    folder = _truncated_model(tiny_dir, tmp_path / "model")
    assert main(["train", f"model.path={folder}", f"train.output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("r1fit: error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"r1fit: error: cannot load model {str(folder)!r}: "
                                f"{folder / 'model.safetensors'} is truncated or corrupt (Error "
                                "while deserializing header: ")
    assert errors[0].endswith("; download or export it again")
    assert "Traceback" not in err


def test_inspect_flags_truncated_weights(capsys, tmp_path, tiny_dir):
    folder = _truncated_model(tiny_dir, tmp_path / "model")
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "  integrity: model.safetensors is truncated or corrupt (" in out
    assert "nor can a new run start from it: its weights are truncated or corrupt" in out
    assert f"model.path={folder}" not in out
    assert main(["inspect", str(tiny_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["intact"] is True and report["problem"] is None


def test_train_into_a_folder_below_a_file_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("")
    assert main(["train", f"train.output_dir={blocker / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("r1fit: error:")] == [
        (f"r1fit: error: train.output_dir={blocker / 'run'}: cannot create or use the output "
         f"folder: {blocker} is a file, not a folder; choose another train.output_dir")]
    assert "Traceback" not in err


def test_plan_on_a_gpu_machine_plans_its_gpus_free_memory(capsys, tmp_path, monkeypatch):
    """Without --device-memory or memory.budget, on a machine with CUDA the plan is for the
    free memory of the GPU train.device names, as a run's auto sizes take it (said on stderr);
    --device-memory and memory.budget still win; without CUDA, no GPU is asked."""
    import torch

    from r1fit import cli

    asked = []

    def mem_get_info(index):
        asked.append(index)
        return 40 << 30, 141 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.this_gpus_free_memory("auto") is None and asked == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.this_gpus_free_memory("cuda:1") == 40 << 30 and asked == [1]
    assert "free memory of this machine's NVIDIA H200 (cuda:1): 40.00 GiB of 141.00 GiB" \
        in capsys.readouterr().err
    assert cli.this_gpus_free_memory("auto") == 40 << 30 and asked == [1, 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the plan's own rates
    monkeypatch.setattr(cli, "this_gpus_free_memory", lambda name: 40 << 30)
    folder = _config_only_model(tmp_path / "model")
    for extra, budget in (([], 40 << 30), (["--device-memory", "2GiB"], 2 << 30),
                          (["memory.budget=3GiB"], 3 << 30), (["train.device=cpu"], 80 << 30)):
        assert main(["plan", f"model.path={folder}", "--json", *extra]) == 0
        assert json.loads(capsys.readouterr().out)["budget_bytes"] == budget, extra
    # on a machine without CUDA the plan is for one elsewhere, said after it
    monkeypatch.setattr(cli, "this_gpus_free_memory", lambda name: None)
    assert main(["plan", f"model.path={folder}", "--json"]) == 0
    assert capsys.readouterr().err.endswith(
        "r1fit plan: planned for a CUDA device (this machine has none; train.device=cpu plans a "
        "run on this CPU)\n")


def test_the_machines_os_errors_are_one_line(monkeypatch, capsys):
    """A full disk mid-run (metrics, thumbnails, a report into a read-only folder) was an OSError
    traceback: one line naming the file, exit 2. Any other OS error is raised as it is."""
    import errno

    import r1fit.cli as cli

    def full(ns):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl")

    monkeypatch.setitem(cli.COMMANDS, "plan", full)
    assert cli.main(["plan"]) == 2
    assert capsys.readouterr().err == ("r1fit: error: /runs/a/metrics.jsonl: No space left on "
                                       "device\n")

    def bug(ns):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setitem(cli.COMMANDS, "plan", bug)
    with pytest.raises(OSError, match="Bad file descriptor"):
        cli.main(["plan"])


def test_a_full_disk_without_a_file_name_says_what_was_written(monkeypatch, capsys):
    import errno

    import r1fit.cli as cli

    def flush(ns):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(cli.COMMANDS, "train", flush)
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err == ("r1fit: error: No space left on device (while writing the "
                                       "run's files; a run resumes from its last complete "
                                       "checkpoint once there is room)\n")
    # a command that runs no training does not talk of resuming one
    for command in ("report", "eval"):
        monkeypatch.setitem(cli.COMMANDS, command, flush)
        assert cli.main([command, "x"] if command == "report" else [command]) == 2
        assert capsys.readouterr().err == "r1fit: error: No space left on device\n"


def test_os_errors_that_name_no_file_are_raised_naming_it(tmp_path):
    """A flush of metrics.jsonl, PIL's save of a rollout image, the report page: a full disk
    names the file, and the report leaves no half page behind."""
    import errno

    import pytest
    from PIL import Image

    import r1fit.report.html as html_module
    from r1fit.errors import naming
    from r1fit.report.rollouts import save_thumbnail

    with pytest.raises(OSError) as caught, naming(tmp_path / "metrics.jsonl"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC,
                                                           str(tmp_path / "metrics.jsonl"))
    with pytest.raises(OSError) as caught:
        save_thumbnail(Image.new("RGB", (8, 8)), tmp_path / "missing", "r1")
    assert caught.value.filename is not None

    page = tmp_path / "report.html"
    real = Path.write_text

    def full(self, *args, **kwargs):
        real(self, "half a page")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(html_module, "build_report", lambda run_dir, out: "<html></html>")
        mp.setattr(Path, "write_text", full)
        with pytest.raises(OSError) as caught:
            html_module.write_report(tmp_path, page)
    assert caught.value.filename == str(tmp_path / "report.html.partial")
    assert list(tmp_path.iterdir()) == []


def test_the_key_reference_takes_no_config(capsys):
    assert main(["config", "--reference", "my.yaml"]) == 2
    assert capsys.readouterr().err.startswith("r1fit: error: r1fit config --reference takes no "
                                              "config or overrides (got my.yaml)")


def test_sft_says_which_grpo_overrides_it_drops(monkeypatch, capsys):
    """`r1fit sft train.max_steps=1` ran sft.steps steps unsaid: a warning names the key it reads
    instead. `r1fit train` reads both: no warning."""
    import r1fit.cli as cli

    ran = []
    monkeypatch.setattr(cli, "_run", lambda command, cfg: ran.append(command))
    assert main(["sft", "train.max_steps=1", "train.learning_rate=0.5", "sft.steps=7"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["r1fit: warning: train.max_steps=1 has no effect on r1fit sft, which reads "
                   "sft.steps (now 7)",
                   "r1fit: warning: train.learning_rate=0.5 has no effect on r1fit sft, which "
                   f"reads sft.learning_rate (now {load_config(None).sft.learning_rate})"]
    assert main(["train", "train.max_steps=1"]) == 0 and ran == ["sft", "train"]
    assert capsys.readouterr().err == ""


def test_config_lists_a_whole_section_override_key_by_key(capsys):
    """`r1fit config 'algo={beta: 0.1}'` was a JSON TypeError traceback."""
    assert main(["config", "algo={beta: 0.1}", "data.shapes={}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    beta = next(line for line in lines if line.startswith("algo.beta "))
    assert beta.split() == ["algo.beta", "0.1", "override"]


def test_empty_sources_and_model_are_refused_naming_the_key(capsys):
    for override, key in (("data.train=", "data.train"), ("data.train=[]", "data.train"),
                          ("data.train=[a.jsonl,'']", "data.train"), ("model.path=", "model.path")):
        assert main(["config", override]) == 2
        assert capsys.readouterr().err.startswith(f"r1fit: error: {key}: got ")


def test_doctor_out_without_check_is_refused(capsys):
    assert main(["doctor", "--out", "somewhere"]) == 2
    assert "--out is where --check writes its run" in capsys.readouterr().err


def test_config_piped_into_head_ends_quietly():
    """`r1fit config | head` printed a BrokenPipeError traceback; the light commands import no
    torch (about 6 s before)."""
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m r1fit config | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("# preset: demo") and done.stderr == ""
    probe = subprocess.run([sys.executable, "-c", "import sys; from r1fit.cli import main; "
                            "main(['config', '--json']); print('torch' in sys.modules, "
                            "file=sys.stderr)"], capture_output=True, text=True, timeout=120)
    assert probe.stderr.strip().splitlines()[-1] == "False"
