"""bench/gpu_suite.py at toy sizes on the CPU: the JSON schema the next GPU session reads, and the markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_suite_quick_cpu_writes_json_and_table(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_suite.py"),
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--quick",
            "--only",
            "copy,matmul,cuda_tests_absent",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown section" in proc.stderr  # a typo is refused, not ignored
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_suite.py"),
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--quick",
            "--only",
            "copy,matmul",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["env"]["device"] == "cpu" and report["env"]["quick"] is True
    assert list(report["sections"]) == ["matmul", "copy"]  # value order, --only respected
    for sec in report["sections"].values():
        assert sec["status"] == "ok" and sec["error"] is None and sec["seconds"] > 0
        assert set(sec) >= {"status", "seconds", "error", "rows", "summary"}
    matmul = report["sections"]["matmul"]
    assert all(r["bf16_tflops"] > 0 for r in matmul["rows"])
    assert matmul["summary"]["measured_peak_bf16_tflops"] == max(r["bf16_tflops"] for r in matmul["rows"])
    assert report["sections"]["copy"]["rows"][0]["gb_per_s"] > 0
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "## matmul: ok" in md and "| shape | m | n | k | bf16_tflops" in md and "|---|" in md
    assert len(list(tmp_path.iterdir())) <= 8  # what a device call brings back


@pytest.mark.slow
def test_gpu_suite_budget_skips_and_records(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_suite.py"),
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--quick",
            "--only",
            "copy,attention",
            "--budget-s",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    for sec in report["sections"].values():
        assert sec["status"] == "skipped" and "budget" in sec["error"]
    assert "## attention: skipped" in (tmp_path / "gpu_suite.md").read_text()


def test_the_fp8_gain_and_its_mfu_are_stated_against_the_targets():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_suite_runs import fp8_gain

    result = {
        "rows": [
            {"row": "3.2b bf16 compile", "tokens_per_s": 100.0, "mfu_datasheet": 0.50},
            {"row": "3.2b fp8 + compile", "tokens_per_s": 120.0, "mfu_datasheet": 0.61},
        ],
        "summary": {},
    }
    fp8_gain(result, mfu_goal=0.60)
    assert result["summary"]["fp8"] == (
        "fp8 + compile / bf16 + compile tokens/s: 1.200x (target >= 1.25x: missed); "
        "fp8 BF16-equivalent MFU 61.0% (goal >= 60%: met)"
    )
    unmeasured = {"rows": [{"row": "3.2b fp8 + compile", "status": "error: RuntimeError"}], "summary": {}}
    fp8_gain(unmeasured)
    assert "fp8" not in unmeasured["summary"]
