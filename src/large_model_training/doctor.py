"""`lmt doctor`: what this installation can do, in one screen, before a run needs it.

torch and its build, the accelerators and collective backends torch can use here, the device and backend
`lmt train` would pick (mesh.py's own choice, not a second copy of it), the optional packages (looked up, not
imported: importing tensorboard or transformers takes seconds) and the planner's hardware entry for the device.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform

# Optional packages: how to install each and what lmt uses it for.
OPTIONAL = {
    "tensorboard": ("pip install 'large-model-training[tensorboard]'", "TensorBoard event files in the run folder"),
    "pyarrow": (
        "pip install 'large-model-training[data]'",
        "Parquet and Arrow (datasets.save_to_disk folders) input for lmt prepare",
    ),
    "zstandard": ("pip install 'large-model-training[data]'", ".jsonl.zst input for lmt prepare"),
    "transformers": ("pip install 'large-model-training[test]'", "the tests' comparisons with Hugging Face models"),
    "torchao": (
        "pip install 'large-model-training[test]'",
        "the tests' float8 reference (Float8Linear; --precision fp8 runs without it)",
    ),
    "datasets": (
        "pip install 'large-model-training[test]'",
        "the tests' save_to_disk folders (lmt reads them with pyarrow alone)",
    ),
    "torch_npu": ("pip install torch-npu, matching torch and Huawei's CANN toolkit", "Ascend NPUs"),
}


def package_status(name: str) -> str:
    """'present (VERSION)' or 'absent', without importing the package."""
    if importlib.util.find_spec(name) is None:
        return "absent"
    try:
        version = importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "version unknown"
    return f"present ({version})"


def report() -> list[tuple[str, str]]:
    """(what, finding) rows, in the order printed."""
    import torch
    import torch.distributed as dist

    from large_model_training.errors import ConfigError
    from large_model_training.mesh import BACKENDS, accelerator_counts, backend_for, device_name, select_device
    from large_model_training.planner.hardware import entry_for_device, load_measured

    counts = accelerator_counts()
    cuda = (
        f"{counts['cuda']} device(s), CUDA {torch.version.cuda}"
        if "cuda" in counts
        else f"none visible (torch built with CUDA {torch.version.cuda})"
        if torch.version.cuda
        else "none (a CPU build of torch)"
    )
    npu = (
        f"{counts['npu']} device(s)"
        if "npu" in counts
        else "torch_npu imports, no NPU visible"
        if importlib.util.find_spec("torch_npu")
        else "torch_npu not installed"
    )
    rows = [("python", platform.python_version()), ("torch", torch.__version__), ("CUDA", cuda), ("NPU", npu)]
    for kind, backend in BACKENDS.items():
        available = dist.is_available() and dist.is_backend_available(backend)
        rows.append(
            (
                backend.upper() if backend != "gloo" else "gloo",
                f"{'available' if available else 'not available'} ({kind} collectives)",
            )
        )
    device = select_device(0)
    forced = " (LMT_DEVICE=cpu)" if os.environ.get("LMT_DEVICE") == "cpu" and counts else ""
    rows.append(("lmt would use", f"{device} ({device_name(device)}), {backend_for(device)} collectives{forced}"))
    if device.type == "cpu":
        try:
            measured = "cpu" in load_measured()
        except ConfigError as e:
            measured, rows = False, rows + [("hardware file", str(e))]
        rows.append(
            (
                "hardware entry",
                "none for a CPU; "
                + ("a measured 'cpu' entry exists (lmt calibrate)" if measured else "`lmt calibrate` measures one"),
            )
        )
    else:
        hw = entry_for_device(device_name(device))
        rows.append(
            (
                "hardware entry",
                f"{hw.name} ({hw.source})"
                if hw
                else "none in the catalogue for this device (lmt plan --hardware NAME picks one)",
            )
        )
    for name, (install, use) in OPTIONAL.items():
        rows.append((name, f"{package_status(name)}: {use}; {install}"))
    return rows


def cmd_doctor(args) -> int:
    rows = report()
    width = max(len(what) for what, _ in rows)
    for what, finding in rows:
        print(f"{what:<{width}}  {finding}")
    return 0
