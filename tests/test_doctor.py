"""`lmt doctor`: each line says what this install has, as torch and the package index see it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from large_model_training.cli import main
from large_model_training.doctor import OPTIONAL
from large_model_training.planner.hardware import entry_for_device


def _doctor(capsys) -> dict[str, str]:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    return {line[:16].strip(): line[16:] for line in out.splitlines()}


def test_doctor_reports_torch_backends_device_and_packages(capsys):
    rows = _doctor(capsys)  # the tests run with LMT_DEVICE=cpu
    assert rows["torch"] == torch.__version__
    assert rows["CUDA"].startswith("none") if not torch.cuda.is_available() else "device(s)" in rows["CUDA"]
    assert rows["gloo"] == "available (cpu collectives)"
    assert rows["NCCL"].startswith("available" if torch.distributed.is_nccl_available() else "not available")
    assert rows["lmt would use"].startswith("cpu (") and rows["lmt would use"].split(", ")[-1].startswith("gloo")
    assert rows["hardware entry"].startswith("none for a CPU")
    for name in OPTIONAL:
        present = importlib.util.find_spec(name) is not None
        assert rows[name].startswith("present (" if present else "absent:"), (name, rows[name])


def test_doctor_names_a_calibrated_cpu_entry_and_an_unreadable_hardware_file(capsys, tmp_path, monkeypatch):
    from dataclasses import asdict, replace

    from large_model_training.planner.hardware import CATALOGUE

    path = tmp_path / "hardware.json"
    path.write_text(json.dumps({"cpu": asdict(replace(CATALOGUE["a100-80gb"], name="cpu", fused_kernels=False))}))
    monkeypatch.setenv("LMT_HARDWARE_FILE", str(path))
    assert "a measured 'cpu' entry exists" in _doctor(capsys)["hardware entry"]
    path.write_text("{not json")
    rows = _doctor(capsys)
    assert rows["hardware file"].startswith("cannot read hardware file") and rows["hardware entry"].startswith("none")


def test_doctor_on_an_accelerator_names_its_catalogue_entry(capsys, monkeypatch):
    """mesh.py's choice stood in for (this machine has no GPU): the report follows it, NCCL and the entry."""
    import large_model_training.mesh as mesh

    monkeypatch.setattr(mesh, "select_device", lambda local_rank=0: torch.device("cuda", 0))
    monkeypatch.setattr(mesh, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    rows = _doctor(capsys)
    assert rows["lmt would use"] == "cuda:0 (NVIDIA H100 80GB HBM3), nccl collectives"
    assert rows["hardware entry"].startswith("h100-sxm (NVIDIA H100 datasheet")


@pytest.mark.parametrize(
    "name,entry",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", None),
        ("Ascend910B3", "ascend-910b"),
        ("NVIDIA GeForce RTX 4090", None),
        ("x86_64", None),
    ],
)
def test_catalogue_entry_by_device_name(name, entry):
    found = entry_for_device(name)
    assert (found.name if found else None) == entry
