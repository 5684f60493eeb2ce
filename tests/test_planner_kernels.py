"""The planner's kernel time by shape (planner/kernel_time.py), the hardware catalogue and its per-run overrides,
and `lmt calibrate --from gpu_suite.json` (issue 35)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from large_model_training.cli import main
from large_model_training.errors import ConfigError
from large_model_training.planner.hardware import CATALOGUE, GB, entry_for_device, get_hardware, with_overrides
from large_model_training.planner.kernel_time import gemm_efficiency, k_ramp, modelled_efficiency, wave_efficiency
from large_model_training.planner.timing import gemm_time

NEW = ("h800", "h20", "b200", "gb200-nvl72", "mi300x", "ascend-910b", "ascend-910c", "cloudmatrix-384")


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_efficiency_grows_with_size_and_never_passes_the_entrys_large_gemm_level(name):
    hw = CATALOGUE[name]
    sizes = [2**i for i in range(7, 15)]
    squares = [gemm_efficiency(hw, "bf16", s, s, s, hw.peak_flops) for s in sizes]
    assert squares == sorted(squares), squares
    assert squares[0] < 0.1 * hw.gemm_efficiency  # one tile on a device of many units
    assert max(squares) <= hw.gemm_efficiency + 1e-12
    along_k = [gemm_efficiency(hw, "bf16", 4096, 4096, k, hw.peak_flops) for k in (16, 64, 256, 1024, 4096, 16384)]
    assert along_k == sorted(along_k)
    assert k_ramp(4096) == k_ramp(65536) == 1.0


def test_wave_quantisation_counts_idle_units_of_the_last_wave():
    hw = replace(CATALOGUE["h100-sxm"], compute_units=132)
    assert wave_efficiency(hw, 128 * 11, 256 * 12) == 1.0  # 132 tiles: one full wave
    # 133 tiles of 128 x 256 or 134 of 256 x 128: either spills into a second wave; the better is taken
    assert wave_efficiency(hw, 128 * 133, 256) == pytest.approx(134 / 264)


def test_a_measured_table_is_matched_at_its_shapes_and_scales_the_model_between():
    hw = CATALOGUE["h100-sxm"]
    table = ((8192, 8192, 8192, "bf16", 700e12), (2048, 512, 2048, "bf16", 300e12), (8192, 8192, 8192, "fp8", 1.3e15))
    measured = replace(hw, gemm_table=table)
    for m, n, k, precision, rate in table:
        peak = measured.gemm_peak(precision)
        assert gemm_efficiency(measured, precision, m, n, k, peak) * peak == pytest.approx(rate)
        assert gemm_time(measured, precision, m, n, k) == pytest.approx(2 * m * n * k / rate + hw.kernel_launch_s)
    # between measured shapes: the model times the nearest measured shape's ratio (8192^3's here)
    ratio = 700e12 / hw.peak_flops / modelled_efficiency(hw, 8192, 8192, 8192)
    assert gemm_efficiency(measured, "bf16", 8192, 4096, 8192, hw.peak_flops) == pytest.approx(
        modelled_efficiency(hw, 8192, 4096, 8192) * ratio
    )
    assert gemm_efficiency(hw, "bf16", 8192, 4096, 8192, hw.peak_flops) == modelled_efficiency(hw, 8192, 4096, 8192)


@pytest.mark.parametrize("name", NEW)
def test_new_entries_carry_sources_and_datasheet_scale_figures(name):
    hw = CATALOGUE[name]
    assert hw.source and hw.name == name
    assert 1e14 < hw.peak_flops < 1e16 and hw.peak_flops_fp32 < hw.peak_flops
    assert 50 * GB <= hw.memory_bytes <= 200 * GB and hw.memory_bandwidth > 1e12
    assert hw.inter_node_bandwidth <= hw.intra_node_bandwidth
    assert 0 < hw.attention_fraction <= hw.gemm_efficiency <= 1


def test_device_names_map_to_their_entries():
    assert entry_for_device("NVIDIA H800").name == "h800"
    assert entry_for_device("NVIDIA H20").name == "h20"
    assert entry_for_device("NVIDIA H200").name == "h200"
    assert entry_for_device("NVIDIA B200").name == "b200"
    assert entry_for_device("NVIDIA GB200").name == "gb200-nvl72"
    assert entry_for_device("AMD Instinct MI300X").name == "mi300x"
    assert entry_for_device("Ascend910C").name == "ascend-910c"


def test_overrides_rescale_links_memory_and_compute():
    hw = CATALOGUE["h100-sxm"]
    assert with_overrides(hw, {"nics-per-node": 4}).inter_node_bandwidth == pytest.approx(hw.inter_node_bandwidth / 2)
    both = with_overrides(hw, {"inter-node-bandwidth": 25, "nics-per-node": 4})  # the count rescales the given one
    assert both.inter_node_bandwidth == pytest.approx(12.5 * GB)
    assert with_overrides(hw, {"memory-gb": 40}).memory_bytes == 40 * GB
    capped = with_overrides(hw, {"power-cap": 350})
    assert capped.gemm_efficiency == pytest.approx(hw.gemm_efficiency * 0.5 ** (1 / 3))
    assert capped.peak_flops == hw.peak_flops  # MFU stays quoted against the datasheet
    assert capped.attention_backward_fraction == pytest.approx(hw.attention_backward_fraction * 0.5 ** (1 / 3))
    assert with_overrides(hw, {"power-cap": 900}).gemm_efficiency == hw.gemm_efficiency
    with pytest.raises(ConfigError, match="no rated power"):
        with_overrides(CATALOGUE["ascend-910c"], {"power-cap": 300})
    with pytest.raises(ConfigError, match="unknown --hardware.bogus"):
        with_overrides(hw, {"bogus": 1})


def _plan_json(capsys, *extra):
    assert (
        main(
            [
                "plan",
                "--model",
                "llama3-8b",
                "--devices",
                "64",
                "--global-batch-size",
                "256",
                "--tp",
                "1",
                "--pp",
                "1",
                "--cp",
                "1",
                "--seq-len",
                "2048",
                "--zero",
                "3",
                "--micro-batch-size",
                "1",
                "--recompute",
                "none",
                "--json",
                *extra,
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)[0]


def test_plan_takes_hardware_overrides_and_flash_attention(capsys):
    base = _plan_json(capsys, "--hardware", "h100-sxm")
    slow_net = _plan_json(capsys, "--hardware", "h100-sxm", "--hardware.nics-per-node", "1")
    capped = _plan_json(capsys, "--hardware", "h100-sxm", "--hardware.power-cap", "400")
    scores = _plan_json(capsys, "--hardware", "h100-sxm", "--flash-attention", "false")
    assert slow_net["step_time_s"] > base["step_time_s"]
    assert capped["step_time_s"] > base["step_time_s"]
    assert scores["memory_per_device_bytes"] > base["memory_per_device_bytes"]
    for name in NEW:
        assert _plan_json(capsys, "--hardware", name)["tokens_per_s"] > 0
    assert main(["plan", "--model", "llama3-8b", "--devices", "8", "--hardware.power-cap", "-3"]) == 2
    assert main(["estimate", "--model", "small", "--hardware.memory-gb", "40"]) == 2  # an override needs an entry
    assert main(["estimate", "--model", "small", "--hardware", "h100-sxm", "--hardware.memory-gb", "40", "--json"]) == 0


def _suite(tmp_path, hardware="h100-sxm"):
    doc = {
        "env": {"device_name": "NVIDIA H100 80GB HBM3", "hardware": hardware},
        "sections": {
            "matmul": {
                "rows": [
                    {
                        "shape": "square 8192",
                        "m": 8192,
                        "n": 8192,
                        "k": 8192,
                        "bf16_tflops": 720.0,
                        "fp8_tflops": 1300.0,
                    },
                    {"shape": "llama-1b tp1 q", "m": 16384, "n": 2048, "k": 2048, "bf16_tflops": 610.0},
                    {"shape": "failed", "m": 1, "n": 1, "k": 1, "bf16_error": "oom"},
                ]
            },
            "attention": {"rows": [{"seq": 2048, "fwd_bwd_tflops": 250.0}, {"seq": 32768, "fwd_bwd_tflops": 380.0}]},
            "copy": {"rows": [{"bytes": 2**30, "gb_per_s": 2900.0}]},
        },
    }
    path = tmp_path / "gpu_suite.json"
    path.write_text(json.dumps(doc))
    return path


def test_calibrate_from_the_gpu_suite_updates_the_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMT_HARDWARE_FILE", str(tmp_path / "hw.json"))
    assert main(["calibrate", "--from", str(_suite(tmp_path))]) == 0
    assert "3 measured GEMMs" in capsys.readouterr().out
    hw = get_hardware("h100-sxm")  # the measured entry now answers for the name
    ds = CATALOGUE["h100-sxm"]
    assert hw.attention_fraction == pytest.approx(380e12 / ds.peak_flops)
    assert hw.memory_efficiency == pytest.approx(2900 / 3350)
    assert gemm_efficiency(hw, "bf16", 8192, 8192, 8192, hw.peak_flops) == pytest.approx(720e12 / ds.peak_flops)
    assert gemm_efficiency(hw, "fp8", 8192, 8192, 8192, hw.peak_flops_fp8) == pytest.approx(1300e12 / 1979e12)
    assert 0.7 < hw.gemm_efficiency < 0.8 and "calibrated from" in hw.source
    assert main(["plan", "--model", "llama3-8b", "--devices", "8", "--hardware", "h100-sxm", "--top", "1"]) == 0


def test_calibrate_from_refuses_what_is_not_the_suites_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMT_HARDWARE_FILE", str(tmp_path / "hw.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["calibrate", "--from", str(bad)]) == 2
    assert main(["calibrate", "--from", str(tmp_path / "missing.json")]) == 2
    assert main(["calibrate", "--from", str(_suite(tmp_path, hardware=None))]) == 2
    assert "--base" in capsys.readouterr().err
    suite = str(_suite(tmp_path, hardware=None))
    assert main(["calibrate", "--from", suite, "--base", "h200", "--name", "h200-m"]) == 0
    assert get_hardware("h200-m").peak_flops == CATALOGUE["h200"].peak_flops


def test_every_plan_carries_the_error_band_of_its_kind_of_run(capsys):
    from large_model_training.config import model_from_preset
    from large_model_training.layout import Job, Layout
    from large_model_training.planner.error_band import RESIDUALS, band

    dense = Job(model_from_preset("llama3-8b"), 8192, 64)
    assert band(dense, Layout(tp=1, pp=1, dp=64, micro_batch_size=1, zero=3))[3] == "FSDP"
    assert band(dense, Layout(tp=8, pp=1, dp=8, micro_batch_size=1, zero=1))[3] == "all"
    assert band(dense, Layout(tp=8, pp=1, dp=4, micro_batch_size=1, cp=2))[3] == "long context"
    assert band(Job(model_from_preset("mixtral-8x7b"), 4096, 64), None)[3] == "MoE"
    assert all(0 < rms < 1 and rows > 0 for rms, rows, _ in RESIDUALS.values())
    assert (
        main(
            [
                "plan",
                "--model",
                "llama3-8b",
                "--devices",
                "64",
                "--hardware",
                "h100-sxm",
                "--zero",
                "3",
                "--tp",
                "1",
                "--pp",
                "1",
                "--cp",
                "1",
                "--seq-len",
                "2048",
                "--top",
                "1",
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert f"error band: +-{RESIDUALS['FSDP'][0]:.0%}" in out and "subset 'FSDP'" in out


def test_the_flash_backward_runs_at_its_own_fraction_where_the_entry_has_one():
    """FlashAttention-2's backward on H100 (0.32 of peak, the FlashAttention-3 paper's figure) is slower than its
    forward (0.35): a block's backward attention is 2.5 x the forward FLOPs at the backward's fraction."""
    from dataclasses import replace

    from large_model_training.config import model_from_preset
    from large_model_training.layout import Job, Layout
    from large_model_training.planner.timing import _block_times

    hw = CATALOGUE["h100-sxm"]
    assert hw.attention_backward_fraction < hw.attention_fraction
    assert CATALOGUE["a100-80gb"].attention_backward_fraction == CATALOGUE["a100-80gb"].attention_fraction
    job, lay = Job(model_from_preset("llama3-8b"), 32768, 1, "bf16"), Layout(1, 1, 1, 1)
    same = replace(hw, attention_backward_efficiency=None)
    slower = _block_times(job, lay, hw, 8).backward - _block_times(job, lay, same, 8).backward
    forward_attention = (
        _block_times(job, lay, hw, 8).forward - _block_times(job, lay, replace(hw, attention_efficiency=1e9), 8).forward
    )
    work = forward_attention * hw.peak_flops * hw.attention_fraction  # the forward's FLOPs (launch aside)
    expected = 2.5 * work / hw.peak_flops * (1 / hw.attention_backward_fraction - 1 / hw.attention_fraction)
    assert slower == pytest.approx(expected, rel=0.01)
