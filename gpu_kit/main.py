"""`python -m gpu_kit`: every section in its own process under its time budget, then gpu-report.json and .md.

run.sh calls it with --comfyui/--pack/--work set; `--dry-run` runs the same code on the CPU with tiny shapes.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import report
from .part import SECTIONS, TRUTHS

# Seconds per section on one H100-class GPU: 12.5 minutes of work; the rest of the 13 is start-up and the
# installation. A section stops starting cases when its budget is spent and says how many it did not run.
BUDGETS = {"seeds": 60, "exact": 170, "dynamic": 90, "speed": 430}  # speed: + inductor compiles of SDXL and Flux
DRY_RUN_BUDGETS = {"seeds": 120, "exact": 120, "dynamic": 120, "speed": 240}
GRACE = 120  # a case under way when the budget runs out may finish; a process still running after that is killed


def commit() -> str:
    manifest = Path(__file__).resolve().parents[2] / "manifest.json"  # in the kit: checks/gpu_kit/main.py
    if manifest.is_file():
        return json.loads(manifest.read_text(encoding="utf-8"))["commit"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                         text=True, check=False)  # not a git checkout: "unknown"
    return out.stdout.strip() or "unknown"


def run_section(name: str, opts, budget: float) -> dict:
    result = Path(opts.work) / f"section-{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gpu_kit.part", name, "--result", str(result), "--comfyui", str(opts.comfyui),
           "--pack", str(opts.pack), "--work", str(opts.work), "--budget", str(budget)]
    if opts.dry_run:
        cmd.append("--dry-run")
    started = time.monotonic()
    print(f"gpu-kit: {SECTIONS[name]} (budget {budget:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, timeout=budget + GRACE, env=os.environ.copy(), check=False)
        crashed = "" if proc.returncode == 0 else f"the section's process exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        crashed = f"killed after {budget + GRACE:.0f} s"
    elapsed = time.monotonic() - started
    if result.is_file() and not crashed:
        data = json.loads(result.read_text(encoding="utf-8"))
    else:
        data = {"name": name, "title": SECTIONS[name], "budget_s": budget, "elapsed_s": round(elapsed, 2),
                "counts": {s: 0 for s in report.STATUSES}, "notes": [crashed], "rows": [], "environment": {},
                "cases": [{"id": name, "status": "error", "numbers": {}, "detail": crashed, "trace": False}]}
        data["counts"]["error"] = 1
    data["status"] = report.section_status(data["cases"], crashed)
    data["process_s"] = round(elapsed, 2)
    print(f"gpu-kit: {name}: {data['status'].upper()} {data['counts']} in {elapsed:.0f} s", flush=True)
    return data


def verdict(sections: list[dict]) -> str:
    statuses = {s["status"] for s in sections}
    return "fail" if "fail" in statuses else "incomplete" if "incomplete" in statuses else "pass"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_kit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--pack", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path.cwd())
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes, a fake cuda:0 (CI)")
    parser.add_argument("--only", action="append", choices=list(SECTIONS), help="run only this section (repeatable)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every section's time budget (a GPU slower than an H100: 2 or 3)")
    opts = parser.parse_args(argv)
    opts.work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(opts.work / TRUTHS, ignore_errors=True)  # this run's sections share their truths, no older run's
    opts.out.mkdir(parents=True, exist_ok=True)
    budgets = DRY_RUN_BUDGETS if opts.dry_run else BUDGETS
    started, clock = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.monotonic()
    sections = [run_section(name, opts, budgets[name] * opts.budget_scale) for name in SECTIONS
                if not opts.only or name in opts.only]
    data = {"format": 1, "verdict": verdict(sections), "dry_run": opts.dry_run, "commit": commit(),
            "started": started, "elapsed_s": round(time.monotonic() - clock, 1), "machine": report.machine(),
            "sections": sections}
    json_path, md_path = opts.out / "gpu-report.json", opts.out / "gpu-report.md"
    report.write(json_path, md_path, data)
    print(f"gpu-kit: {data['verdict'].upper()} in {data['elapsed_s']:.0f} s: {json_path}, {md_path}", flush=True)
    return 0 if data["verdict"] == "pass" else 1
