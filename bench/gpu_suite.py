"""One prepared command for the occasional GPU (issue 32): everything worth measuring, in under 8 minutes.

Each section runs in its own try/except with a time budget: a failing measurement records its error and the
others go on; a section that would overrun the global budget is recorded as skipped. The JSON and the markdown
table are rewritten after every section, so a run killed at its limit still leaves what it measured.

On the device machine (a fresh one has no tomli_w, which `lmt train` needs for config.toml; carry its wheel):

    # here, once, in the repository root that the device call sends:
    echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps -d .whl tomli-w==1.2.0
    # device run, carry [".whl"], timeout_s 560:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;
    PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --out $OUT

    python bench/gpu_suite.py --out /tmp/suite --device cpu --quick      # toy sizes: proves every code path
    python bench/gpu_suite.py --out DIR --only matmul,train --budget-s 200

Sections (value order): matmul, train (llama-1b eager / compile), copy, attention, small_vs_plain, fused_loss,
train_3b, cuda_tests. Writes DIR/gpu_suite.json, DIR/gpu_suite.md and DIR/gpu_suite.log (subprocess output).
The source tree's src/ is put on PYTHONPATH, so no install is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from large_model_training.mesh import select_device  # noqa: E402
from gpu_suite_sections import Context, section_attention, section_copy, section_matmul  # noqa: E402
from gpu_suite_runs import (section_cuda_tests, section_fused_loss, section_small_vs_plain,  # noqa: E402
                            section_train, section_train_3b)

SECTIONS = {  # name: (function, seconds it is expected to take on one H100; skipped if less is left), value order
    "matmul": (section_matmul, 25), "train": (section_train, 150), "copy": (section_copy, 5),
    "attention": (section_attention, 15), "small_vs_plain": (section_small_vs_plain, 45),
    "fused_loss": (section_fused_loss, 30), "train_3b": (section_train_3b, 100), "cuda_tests": (section_cuda_tests, 40),
}
ORDER = list(SECTIONS)


def markdown(report: dict) -> str:
    env = report["env"]
    out = ["# GPU suite (bench/gpu_suite.py)", "",
           f"device {env['device']} ({env['device_name']}), torch {env['torch']}, catalogue entry "
           f"{env['hardware'] or 'none'}, quick {env['quick']}; {report['elapsed_s']:.0f} s of a "
           f"{env['budget_s']:.0f} s budget.", "",
           "Conventions: matmul 2mnk FLOPs; attention causal forward = half of 4*b*h*s^2*d, backward 2.5x "
           "forward (forward+backward 3.5x); copy counts bytes read + written; MFU = "
           "models/flops.training_flops_per_token x tokens/s over the datasheet bf16 peak and over the best "
           "measured bf16 matmul rate; step rows averaged after the first steps (warm-up, compile).",
           "Targets: llama-1b bf16 + compile >= 50% datasheet MFU; peak memory within 5% of `lmt estimate`; "
           "`small` >= 1.0x plain.", ""]
    for name, sec in report["sections"].items():
        head = f"## {name}: {sec['status']}"
        if sec.get("seconds") is not None:
            head += f" ({sec['seconds']:.1f} s)"
        out += [head, ""]
        if sec.get("error"):
            out += [f"error: `{sec['error']}`", ""]
        for key, value in sec.get("summary", {}).items():
            out.append(f"- {key}: {_cell(value)}")
        if sec.get("summary"):
            out.append("")
        rows = sec.get("rows") or []
        if rows:
            cols = list(dict.fromkeys(k for r in rows for k in r))
            out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
            out.append("")
        if sec.get("text"):
            out += [sec["text"], ""]
    return "\n".join(out) + "\n"


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v).replace("|", "/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default=None, help="cpu: force the CPU (default: the accelerator if any)")
    ap.add_argument("--quick", action="store_true", help="toy sizes, to prove the code paths")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ORDER)}")
    ap.add_argument("--budget-s", type=float, default=450.0)
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(ORDER)
    if unknown:
        print(f"gpu_suite: unknown section(s) {sorted(unknown)}; choose from {ORDER}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    device = select_device(0, prefer_cpu=args.device == "cpu")
    ctx = Context(device=device, quick=args.quick, out=Path(args.out), budget_s=args.budget_s,
                  root=ROOT, start=time.perf_counter())
    report = {"env": ctx.env(), "sections": {}, "elapsed_s": 0.0}
    ctx.log(f"device {device} {report['env']['device_name']}, budget {args.budget_s:.0f} s, quick {args.quick}")
    for name in ORDER:
        if only and name not in only:
            continue
        fn, estimate_s = SECTIONS[name]
        estimate_s = 5.0 if args.quick else estimate_s
        sec: dict = {"status": "skipped", "seconds": None, "error": None, "rows": [], "summary": {}}
        if ctx.remaining() < estimate_s:
            sec["error"] = f"needs ~{estimate_s:.0f} s, {ctx.remaining():.0f} s of the budget left"
            ctx.log(f"{name}: skipped ({sec['error']})")
        else:
            ctx.log(f"{name}: start (estimate {estimate_s:.0f} s)")
            t0 = time.perf_counter()
            try:
                sec.update(fn(ctx))
                sec["status"] = sec.get("status_override") or "ok"
                sec.pop("status_override", None)
            except Exception as e:  # one failing measurement must not lose the others
                sec["status"], sec["error"] = "error", f"{type(e).__name__}: {e}"[:2000]
                ctx.log_exception(name)
            sec["seconds"] = time.perf_counter() - t0
            ctx.log(f"{name}: {sec['status']} in {sec['seconds']:.1f} s" + (f" ({sec['error']})" if sec["error"] else ""))
        report["sections"][name] = sec
        report["elapsed_s"] = ctx.elapsed()
        _write(ctx.out, report)
    ctx.log(f"done in {ctx.elapsed():.0f} s: {ctx.out / 'gpu_suite.md'}")


def _write(out: Path, report: dict) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_suite.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
