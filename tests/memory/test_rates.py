"""The device rates of the time model: a quick calibration measures positive rates and caches
them where `r1fit plan` finds them; the lookups on hand-made rates; data sheets for a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from r1fit.cli import main
from r1fit.memory import rates as rates_module
from r1fit.memory.rates import (
    DeviceRates,
    calibrate,
    calibration_path,
    datasheet_rates,
    device_rates,
    load_calibration,
)

CPU = torch.device("cpu")


def made(**changes) -> DeviceRates:
    values = dict(device="test", key="test",
                  matmul={"float32": [(128, 1e9), (512, 4e9), (2048, 8e9)]},
                  copy_bytes_per_s=1e10, launch_s=2e-6, layer_step_s=[(1, 3e-4), (16, 6e-4)],
                  disk_bytes_per_s=1e8, source="test")
    return DeviceRates(**{**values, **changes})


def test_the_lookups_on_hand_made_rates():
    r = made()
    # the rate of the nearest measured size at or below the one asked; the smallest below it
    assert r.matmul_rate("float32", 64) == 1e9
    assert r.matmul_rate("float32", 600) == 4e9
    assert r.matmul_rate("float32", 4096) == 8e9
    assert r.matmul_rate("bfloat16", 600) == 4e9  # not measured: float32's
    # the layer step extrapolated to zero rows: 3e-4 - (3e-4 / 15) * 1 = 2.8e-4
    assert r.layer_overhead_s() == pytest.approx(2.8e-4)
    # a step that shrinks with rows (noise): never below a launch
    assert made(layer_step_s=[(1, 1e-6), (16, 1e-3)]).layer_overhead_s() == 2e-6
    assert DeviceRates.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    # a decode step's products: the skinny rates interpolated in rows, never above the square
    # rate; the square rate where none was measured
    assert r.skinny_rate("float32", 8, 600) == 4e9
    skinny = made(skinny={"float32": [(1, 1e8), (16, 2e9)]})
    # between two measured row counts, linear in rows: 1e8 + 1.9e9 x 7 / 15
    assert skinny.skinny_rate("float32", 8, 600) == pytest.approx(1e8 + 1.9e9 * 7 / 15)
    assert skinny.skinny_rate("float32", 1, 600) == 1e8
    assert skinny.skinny_rate("float32", 32, 600) == 2e9
    assert skinny.skinny_rate("float32", 32, 64) == 1e9  # the square rate at 64 is lower
    assert DeviceRates.from_dict(json.loads(json.dumps(skinny.to_dict()))) == skinny


def test_elementwise_work_is_what_the_calibration_layer_spends_beyond_its_matmuls():
    # the calibration layer over 100 tokens: 2 x 100 x (2 x 256^2 + 2 x 256 x 128 + 3 x 256 x
    # 704) = 147,456,000 matrix FLOPs and 2 x 256 x 100^2 = 5,120,000 attention FLOPs, at the
    # 1e9 FLOP/s measured at width 128 (the nearest at or below 256): 0.152576 s; training
    # three times that; the fixed cost per layer forward 2.8e-4 s (once, three times)
    flops = 147_456_000 + 5_120_000
    r = made(layer_tokens_s={"float32": (100, flops / 1e9 + 2.8e-4 + 0.05,
                                         3 * flops / 1e9 + 3 * 2.8e-4 + 0.2)})
    forward, train = r.elementwise_s("float32", 512)
    # what remains, per token, at twice the calibration layer's width
    assert forward == pytest.approx(0.05 / 100 * 2)
    assert train == pytest.approx(0.2 / 100 * 2)
    assert r.elementwise_s("bfloat16", 512) == (forward, train)  # float32's, not measured
    assert DeviceRates.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    # never below nothing; uncalibrated: 240 bytes per token and unit of width at the bandwidth
    assert made(layer_tokens_s={"float32": (100, 1e-3, 1e-3)}).elementwise_s("float32", 512) \
        == (0.0, 0.0)
    assert made().elementwise_s("float32", 512) == pytest.approx((240 * 512 / 1e10,
                                                                   3 * 240 * 512 / 1e10))


def test_contradicting_measurements_are_doubted():
    """What other load on the machine makes of a calibration: a layer's forward and backward no
    slower than its forward, no element-wise work left, the largest matmul far slower."""
    flops = 147_456_000 + 5_120_000
    sound = made(layer_tokens_s={"float32": (100, flops / 1e9 + 2.8e-4 + 0.05,
                                             3 * flops / 1e9 + 3 * 2.8e-4 + 0.2)})
    assert sound.doubts() == []
    loaded = made(matmul={"float32": [(128, 1e9), (512, 8e9), (2048, 1e9)]},
                  layer_tokens_s={"float32": (100, 0.32, 0.05)})
    assert loaded.doubts() == [
        "the float32 layer's forward and backward (50.00 ms) took no longer than its forward "
        "(320.00 ms)",
        "the largest float32 matmul ran at 1.0 GFLOP/s, under a quarter of a smaller one's 8.0"]
    assert made(layer_tokens_s={"float32": (100, 1e-3, 2e-3)}).doubts() == [
        "the float32 layer's element-wise work came out at 0"]


def test_a_quick_calibration_is_cached_for_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    assert load_calibration(CPU) is None
    assert not device_rates("cpu").calibrated  # rough figures until calibrated
    measured = calibrate(CPU, quick=True)
    assert measured.calibrated and measured.copy_bytes_per_s > 0 and measured.launch_s > 0
    assert all(rate > 0 for curve in measured.matmul.values() for _, rate in curve)
    assert set(measured.matmul) == {"float32", "bfloat16"}
    assert [rows for rows, _ in measured.layer_step_s] == [1, 16]
    assert all(seconds > 0 for _, seconds in measured.layer_step_s)
    assert measured.disk_bytes_per_s > 0
    assert measured.sample_s_per_logit > 0 and measured.head_s_per_logit > 0
    assert set(measured.skinny) == {"float32", "bfloat16"}
    assert measured.generate_step_s >= 0  # the loop's cost beyond the layers: can round to 0
    assert measured.generate_s_per_logit >= 0
    assert all(rate > 0 for curve in measured.skinny.values() for _, rate in curve)
    assert set(measured.layer_tokens_s) == {"float32", "bfloat16"}
    assert all(tokens == 64 and 0 < forward < train
               for tokens, forward, train in measured.layer_tokens_s.values())
    assert measured.optimizer_s_per_tensor > 0 and measured.lora_s_per_linear > 0
    # a copy into new memory (FSDP2's buffers); the link is not measured by a quick one
    assert 0 < measured.fresh_copy_bytes_per_s == measured.fresh_copy_rate()
    assert measured.link_bytes_per_s > 0 and "not measured" in measured.link_source
    assert calibration_path(CPU).parent == tmp_path / "calibration"
    assert device_rates("cpu") == measured == load_calibration(CPU)
    # an unreadable cache is measured again, not trusted
    calibration_path(CPU).write_text("{not json")
    assert load_calibration(CPU) is None


def test_doctor_calibrate_prints_and_caches(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    real = rates_module.calibrate
    monkeypatch.setattr(rates_module, "calibrate", lambda: real(CPU, quick=True))
    # r1fit's own two GRPO runs (tests/doctor/test_steps.py): their answer, here
    monkeypatch.setattr("r1fit.doctor.steps.measure_step_fixed", lambda device: (2e-3, 1e-3))
    assert main(["doctor", "--calibrate", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"].startswith("calibrated")
    assert (printed["micro_batch_s"], printed["update_s"]) == (2e-3, 1e-3)
    assert load_calibration(CPU).micro_batch_s == 2e-3  # cached with the rest
    assert printed["path"] == str(calibration_path(CPU))
    assert load_calibration(CPU) is not None
    # on a busy machine: warned, and the doubt kept in the file's notes
    monkeypatch.setattr("r1fit.doctor.command.os.getloadavg", lambda: (9.0, 9.0, 9.0))
    assert main(["doctor", "--calibrate", "--json"]) == 0
    capsys.readouterr()
    notes = load_calibration(CPU).notes
    assert any(n.startswith("doubt: the machine was busy when it started (load 9.0 on") for n in notes)


def test_gpu_rates_from_data_sheets():
    h200 = datasheet_rates("NVIDIA H200")
    assert h200.matmul_rate("bfloat16", 4096) == 989e12
    assert h200.copy_bytes_per_s == 4.8e12 and not h200.calibrated
    # eager decode and peft's adapters at what the H100 rows of 2026-11-26 measured
    assert h200.layer_overhead_s() == pytest.approx(28e-3 / 36)
    assert h200.lora_s_per_linear == pytest.approx(31e-3 / 252)
    unknown = datasheet_rates("Some Future GPU")
    assert "unknown" in unknown.source and unknown.matmul_rate("bfloat16", 1) == 989e12


@pytest.mark.parametrize("name,per_direction,kind", [
    ("NVIDIA H100 80GB HBM3", 450e9, "NVLink 4"),
    ("NVIDIA H100 PCIe", 64e9, "PCIe 5"),
    ("NVIDIA H200", 450e9, "NVLink 4"),
    ("NVIDIA A100-SXM4-80GB", 300e9, "NVLink 3"),
    ("NVIDIA A100-PCIE-40GB", 32e9, "PCIe 4"),
    ("NVIDIA L40S", 32e9, "PCIe 4"),
    ("Some Future GPU", 32e9, "PCIe 4, assumed"),
])
def test_the_link_between_gpus_from_data_sheets(name, per_direction, kind):
    rates = datasheet_rates(name)
    assert rates.link_bytes_per_s == pytest.approx(0.8 * per_direction)
    assert rates.collective_s == 30e-6
    assert rates.link_source.startswith(f"data sheet ({kind}: ")


def test_a_calibration_cached_before_links_were_measured(tmp_path, monkeypatch):
    """A cached file without the link's fields still plans: with the rough figures, said."""
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    old = {k: v for k, v in made(source="calibrated 2026-11-01").to_dict().items()
           if k not in ("link_bytes_per_s", "collective_s", "link_source")}
    calibration_path(CPU).parent.mkdir(parents=True)
    calibration_path(CPU).write_text(json.dumps(old))
    loaded = load_calibration(CPU)
    assert loaded.calibrated and loaded.link_bytes_per_s == 5e8 and loaded.collective_s == 2e-4
    assert "not measured (calibrated before links were)" in loaded.link_source
    # a CPU's calibration is per thread count: another process's threads find none here
    other = 7 if torch.get_num_threads() != 7 else 5
    assert load_calibration(CPU, other) is None
    rough = device_rates("cpu", threads=other)
    assert f"OMP_NUM_THREADS={other} r1fit doctor --calibrate" in rough.source
    assert f"({other} threads)" in rough.device
