import json

from r1fit.cli import main


def test_config_prints_resolved_values(capsys):
    assert main(["config", "algo.num_generations=4", "model.lora.r=8"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["algo"]["num_generations"] == 4 and cfg["model"]["lora"]["r"] == 8


def test_config_reference_lists_every_key(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "| `memory.micro_batch` |" in out and "| `algo.beta` |" in out


def test_missing_config_file_is_one_line(capsys, tmp_path):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("r1fit: error: config file not found") and "\n" not in err
