"""One section in its own process: `python -m gpu_kit.part <section> --result FILE ...` (main.py starts it).

Its own process because dynamic VRAM changes ComfyUI's global state (comfy-aimdo's allocator, the core patcher
class) for the rest of a process, and because a CUDA error or an out-of-memory can leave a process unusable: the
other sections still run and report.
"""

import argparse
import json
import sys
from pathlib import Path

TRUTHS = "truths"  # the folder under the work folder where the sections of one run share the reference's truths
SECTIONS = {
    "seeds": "1. The reported failures (seeds)",
    "exact": "2. Exactness: full and lowvram loads",
    "dynamic": "2b. Exactness and strength change under dynamic VRAM",
    "speed": "3. Speed against ComfyUI's own path",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--pack", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--budget", type=float, required=True)
    parser.add_argument("--dry-run", action="store_true")
    opts = parser.parse_args(argv)

    from . import env as kit_env

    env = kit_env.setup(opts.comfyui, opts.pack, opts.dry_run, dynamic=opts.section == "dynamic")
    from . import report

    clock = report.Clock(opts.budget)
    notes, rows = [], []
    context = Context(env, opts.work)
    if opts.section == "seeds":
        from . import seeds

        cases = seeds.run(context, clock)
    elif opts.section == "exact":
        from . import exact

        cases = exact.run(context, clock, ("full", "lowvram"))
    elif opts.section == "dynamic":
        from . import exact, seeds

        if env.dry_run:  # ModelPatcherDynamic is a plain ModelPatcher on a CPU: the kit's code runs, aimdo does not
            notes.append("dry run: ModelPatcherDynamic falls back to ModelPatcher on a CPU, so this runs the kit's "
                         "dynamic-VRAM code paths without comfy-aimdo (the pack under 0.33's dynamic cast is "
                         "emulated by tests/test_bypass_dynamic.py)")
        if env.dry_run or env.dynamic_vram:
            cases = seeds.run_dynamic(context, clock) + exact.run(context, clock, ("dynamic",))
        else:
            cases = [report.Case("dynamic", "fail", detail=f"dynamic VRAM did not start: {env.why_not_dynamic}")]
            notes.append(f"not run: {env.why_not_dynamic}")
    else:
        from . import speed

        cases, rows = speed.run(context, clock)
        notes.append("ratio = ours / ComfyUI's; report-only rows: the numbers are the evidence (no goal is set "
                     "for a GPU yet)")
    data = report.section(opts.section, SECTIONS[opts.section], cases, clock, notes, rows,
                          {"device": str(env.device), "dynamic_vram": env.dynamic_vram})
    opts.result.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return 0


class Context:
    """What the sections read: the environment's fields, and the private work folder for their files."""

    def __init__(self, env, work: Path):
        self.dry_run, self.device, self.work = env.dry_run, env.device, str(work)


if __name__ == "__main__":
    sys.exit(main())
