"""Benchmark of the tools (issue #14): our extraction and resizing against ComfyUI's "Extract and Save Lora".

    .venv/bin/python bench/tools.py             # the SDXL subset below, 3 repetitions (about 5 minutes on 2 cores)
    .venv/bin/python bench/tools.py --quick     # the four smallest shapes of the subset (about 1 minute)
    .venv/bin/python bench/tools.py --shapes all --repeats 5
    .venv/bin/python bench/tools.py --threads 1  # on a shared machine (see --help)

One process, CPU, the same weights for both sides. For every layer shape of the subset: a random fp16 base W (std
0.02) and a tuned W_t = fp16(W + ΔW), ΔW a realistic fine-tune change: rank 64 with σᵢ ∝ 1/i, plus Gaussian noise of
0.3× its norm, ‖ΔW‖ = 3% of ‖W‖. Both sides get the same pair and take the difference D = W_t − W in fp32 (what
ComfyUI's ModelSubtract hands its node); errors are measured against that D.

- core: the difference in fp32, `comfy_extras.nodes_lora_extract.extract_lora(D, rank)` then `.half()` (the node's
  per-weight work: full SVD, clamp of the factors at their 0.99 quantile, fp16 storage).
- ours: the Extract tool's per-weight work, `lycoris_core.tools.extract.extract_weight(W, W_t, rank_rule("fixed",
  rank), dtype=fp16)`: the difference, lowrank.low_rank (randomized SVD for small fixed ranks on layers at least 1024
  wide, full SVD otherwise; balanced √σ factors, alpha = rank) and the error measured on the stored tensors.

Rows (each measured n times, the two sides in turn, the order swapped every repetition; harness.Row conventions):
(a) extract r16 / r64: time of every layer of the subset weighted by how many layers of that shape SDXL's UNet has
    (the time of those layers, `count` below), and the relative Frobenius error ‖D − up@down‖/‖D‖ of the tensors as
    stored (fp16, both sides measured the same way), pooled over the layers (√(Σ count·‖residual‖²)/√(Σ count·‖D‖²)).
(b) resize r64 -> r16: a LoCon of rank 64 (our extraction at rank 64, written with the pack's writer and read back
    through our loader, lycoris_core.load) reduced to rank 16. Ours: the module's change as Factors (tools.changes)
    and the SVD of the factors (QR + a 64x64 SVD, never forming ΔW). Core path (the only one ComfyUI has: apply the
    LoRA, subtract, extract): the dense change up @ down, then extract_lora. Error against the file's change.
(c) sv_fro 0.9 (kohya's dynamic rule) for the record: extraction (full SVD of D) and resize (factored); ours only,
    with the mean rank chosen and the pooled error.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import harness  # noqa: F401  (first: ComfyUI on sys.path in CPU mode, the pack importable)
import torch
from comfy_extras.nodes_lora_extract import extract_lora
from harness import BENCH, Row, table
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.lycoris_core.tools import lowrank
from lycoris_nodes.lycoris_core.tools.changes import module_change
from lycoris_nodes.lycoris_core.tools.extract import extract_weight, rank_rule
from lycoris_nodes.lycoris_core.tools.writer import write
from unet_shapes import lora_prefix, unet_weights

FP16 = torch.float16
# The most common SDXL UNet shapes (709 of its 794 Linear/Conv layers) and one 3x3 conv; `--quick` keeps the first four.
SUBSET = [(1280, 1280), (640, 640), (1280, 2048), (640, 640, 3, 3), (10240, 1280), (1280, 5120)]
QUICK = 4
CHANGE_RANK, NOISE, CHANGE_SIZE = 64, 0.3, 0.03
FILE_RANK, RESIZED_RANK, SV_FRO = 64, 16, 0.9
EXTRACT_RANKS = (16, 64)


@dataclass
class Layer:
    key: str  # an SDXL weight of this shape
    shape: tuple[int, ...]
    count: int  # how many weights of this shape SDXL's UNet has
    base: torch.Tensor  # fp16
    tuned: torch.Tensor  # fp16
    diff: torch.Tensor  # fp32, W_t - W: what the errors are measured against


def orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=gen))[0]


def make_layer(key: str, shape: tuple[int, ...], count: int, gen: torch.Generator) -> Layer:
    out, flat = shape[0], math.prod(shape[1:])
    base = (torch.randn(shape, generator=gen) * 0.02).to(FP16)
    sigma = 1.0 / torch.arange(1, CHANGE_RANK + 1, dtype=torch.float32)
    low = (orthonormal(out, CHANGE_RANK, gen) * sigma) @ orthonormal(flat, CHANGE_RANK, gen).T
    noise = torch.randn(out, flat, generator=gen)
    change = low / low.norm() + NOISE * noise / noise.norm()
    change = change * (CHANGE_SIZE * float(base.float().norm()) / float(change.norm()))
    tuned = (base.float() + change.reshape(shape)).to(FP16)
    return Layer(key, shape, count, base, tuned, tuned.float() - base.float())


def layers(which: list[tuple[int, ...]], seed: int = 5) -> list[Layer]:
    weights = unet_weights("sdxl")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in which:
        keys = [k for k, s in weights.items() if s == shape]
        out.append(make_layer(keys[0], shape, len(keys), gen))
    return out


def all_shapes() -> list[tuple[int, ...]]:
    seen: dict[tuple[int, ...], None] = {}
    for shape in unet_weights("sdxl").values():
        seen.setdefault(shape, None)
    return list(seen)


def log(message: str) -> None:
    print(message, flush=True)


def randomized_svd(shape: tuple[int, ...], rank: int) -> bool:
    """Whether lowrank.spectrum takes its randomized path for this layer and fixed rank (its own rule)."""
    side = min(shape[0], math.prod(shape[1:]))
    return side >= lowrank.RANDOMIZED_MIN_SIDE and rank * lowrank.RANDOMIZED_MAX_SHARE <= side


# ---- the two sides -----------------------------------------------------------------------------------------------

def core_factors(change: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the core node stores for one weight."""
    up, down = extract_lora(change, rank)
    return up.contiguous().half(), down.contiguous().half()


def our_factors(change, shape: tuple[int, ...], rule: lowrank.RankRule) -> tuple[torch.Tensor, torch.Tensor, int]:
    result = lowrank.low_rank(change, shape, rule, FP16)
    return result.tensors["lora_up.weight"], result.tensors["lora_down.weight"], result.rank  # alpha = rank: scale 1


def residual(change: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple[float, float]:
    """(‖D − up@down‖², ‖D‖²) in fp64, the factors as stored."""
    d = change.reshape(change.shape[0], -1).double()
    approx = up.reshape(up.shape[0], -1).double() @ down.reshape(down.shape[0], -1).double()
    return float((d - approx).square().sum()), float(d.square().sum())


class Pooled:
    """Σ count·‖residual‖² and Σ count·‖D‖² over the layers: the relative error of all of them together."""

    def __init__(self):
        self.res, self.energy, self.worst = 0.0, 0.0, 0.0

    def add(self, count: int, res: float, energy: float) -> None:
        self.res += count * res
        self.energy += count * energy
        self.worst = max(self.worst, math.sqrt(res / energy) if energy else 0.0)

    @property
    def error(self) -> float:
        return math.sqrt(self.res / self.energy) if self.energy else 0.0


@dataclass
class Side:
    """One side of one row in one repetition: weighted seconds, pooled error, ranks chosen."""

    seconds: float = 0.0
    pooled: Pooled = field(default_factory=Pooled)
    ranks: list[int] = field(default_factory=list)


def run_side(cases, work) -> Side:
    """work(case) -> (change, up, down, rank), timed; `cases` are (count, case)."""
    side = Side()
    for count, case in cases:
        start = time.perf_counter()
        change, up, down, rank = work(case)
        seconds = time.perf_counter() - start
        side.seconds += count * seconds
        side.pooled.add(count, *residual(change, up, down))
        side.ranks.append(rank)
    return side


def alternate(sides: dict, repeats: int) -> dict[str, list[Side]]:
    """Each side once per repetition, in turn, the order reversed every other repetition."""
    runs = {name: [] for name in sides}
    for i in range(repeats):
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            runs[name].append(sides[name]())
    return runs


# ---- rows --------------------------------------------------------------------------------------------------------

def error_note(label: str, sides: list[Side]) -> str:
    errors = [s.pooled.error for s in sides]
    return f"{label} error {min(errors):.4f}-{max(errors):.4f} (worst layer {max(s.pooled.worst for s in sides):.4f})"


def pair_rows(name: str, ours: list[Side], core: list[Side], extra: str = "") -> list[Row]:
    """The time row (goal: ours no slower than the core) and the error row (goal: ours no larger than the core's)."""
    note = f"{error_note('ours', ours)}; {error_note('core', core)}{extra}"
    return [Row(f"{name} time", [s.seconds for s in ours], [s.seconds for s in core], "<=1.0", 1.0, note=note),
            Row(f"{name} error", [s.pooled.error for s in ours], [s.pooled.error for s in core], "<=1.0", 1.0,
                unit="", note="relative Frobenius error of the stored fp16 factors, pooled over the layers")]


def ours_extract(rule: lowrank.RankRule, layer: Layer):
    """The extract tool's per-weight work (lycoris_core.tools.extract), error measured on what it stores included."""
    result = extract_weight(layer.base, layer.tuned, rule, dtype=FP16, device="cpu")
    if result.form != "locon":
        raise RuntimeError(f"{layer.key}: extracted as {result.form}, not a LoCon")
    return layer.diff, result.tensors["lora_up.weight"], result.tensors["lora_down.weight"], result.rank


def core_extract(rank: int, layer: Layer):
    """The core node's per-weight work: the difference (ModelSubtract's patch), extract_lora, fp16."""
    change = layer.tuned.float() - layer.base.float()
    return (layer.diff, *core_factors(change, rank), rank)


def extract_rows(subset: list[Layer], repeats: int) -> list[Row]:
    rows = []
    cases = [(layer.count, layer) for layer in subset]
    for rank in EXTRACT_RANKS:
        runs = alternate({"ours": partial(run_side, cases, partial(ours_extract, rank_rule("fixed", rank))),
                          "core": partial(run_side, cases, partial(core_extract, rank))}, repeats)
        randomized = [la.shape for la in subset if randomized_svd(la.shape, rank)]
        extra = f"; randomized SVD on {randomized}" if randomized else ""
        rows += pair_rows(f"(a) extract r{rank}", runs["ours"], runs["core"], extra)
        log(rows[-2].line())
        log(rows[-1].line())
    return rows


def lora_file(subset: list[Layer], folder: Path) -> Path:
    """A rank-64 LoCon of every layer's change, written by the pack's writer, read back by our loader."""
    tensors = {}
    for layer in subset:
        result = extract_weight(layer.base, layer.tuned, rank_rule("fixed", FILE_RANK), dtype=FP16, device="cpu")
        prefix = lora_prefix(layer.key)
        tensors.update({f"{prefix}.{suffix}": t for suffix, t in result.tensors.items()})
    path = folder / "locon_r64.safetensors"
    write(str(path), tensors, {"ss_network_module": "lycoris.kohya", "ss_network_dim": str(FILE_RANK)})
    return path


def file_changes(subset: list[Layer], path: Path) -> list[tuple[int, tuple]]:
    """(count, (shape, plan, tensors, dense change)) per layer, from the file as our loader reads it."""
    lfile = load(path)
    cases = []
    for layer in subset:
        (module,) = [m for m in lfile.modules.values() if m.prefix == lora_prefix(layer.key)]
        plan = module.plan_for(layer.shape)
        dense = module_change(plan, module.tensors, 1.0, None, torch.device("cpu")).dense().reshape(layer.shape)
        cases.append((layer.count, (layer.shape, plan, module.tensors, dense)))
    return cases


def resize_rows(subset: list[Layer], repeats: int, folder: Path) -> tuple[list[Row], list]:
    cases = file_changes(subset, lora_file(subset, folder))
    cpu = torch.device("cpu")
    rule = lowrank.RankRule("fixed", RESIZED_RANK)

    def ours(case):
        shape, plan, tensors, dense = case
        factors = module_change(plan, tensors, 1.0, None, cpu)
        return (dense, *our_factors(factors, shape, rule))

    def core(case):
        shape, plan, tensors, dense = case
        change = module_change(plan, tensors, 1.0, None, cpu).dense().reshape(shape)
        return (dense, *core_factors(change, RESIZED_RANK), RESIZED_RANK)

    runs = alternate({"ours": lambda: run_side(cases, ours), "core": lambda: run_side(cases, core)}, repeats)
    rows = pair_rows(f"(b) resize r{FILE_RANK}->r{RESIZED_RANK}", runs["ours"], runs["core"],
                     "; ours: SVD of the factors (QR + 64x64 SVD); core: up@down then extract_lora")
    for row in rows:
        log(row.line())
    return rows, cases


def dynamic_rows(subset: list[Layer], resize_cases: list, repeats: int) -> list[Row]:
    rule = lowrank.RankRule("sv_fro", SV_FRO)
    cpu = torch.device("cpu")
    extract_cases = [(layer.count, layer) for layer in subset]

    def resize(case):
        shape, plan, tensors, dense = case
        return (dense, *our_factors(module_change(plan, tensors, 1.0, None, cpu), shape, rule))

    rows = []
    for name, cases, work in (("extract", extract_cases, partial(ours_extract, rank_rule("energy", SV_FRO))), ("resize r64", resize_cases, resize)):
        runs = [run_side(cases, work) for _ in range(repeats)]
        ranks = runs[0].ranks
        note = (f"ranks {min(ranks)}-{max(ranks)} (mean {sum(ranks) / len(ranks):.1f} over the shapes); "
                f"{error_note('pooled', runs)}; no core counterpart (fixed rank only)")
        rows.append(Row(f"(c) {name} sv_fro {SV_FRO} time", [s.seconds for s in runs], None, "report", note=note))
        log(rows[-1].line())
    return rows


# ---- output ------------------------------------------------------------------------------------------------------

def comfy_version() -> str:
    import comfyui_version

    return comfyui_version.__version__


def write_table(rows: list[Row], subset: list[Layer], command: str, minutes: float, load: tuple[float, float],
                path: Path) -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor())
    shapes = ", ".join(f"{'x'.join(map(str, la.shape))} ×{la.count}" for la in subset)
    lines = [
        "# Tools benchmark: extraction and resizing vs ComfyUI's Extract and Save Lora (issue #14)",
        "",
        (f"`{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs ({cpu}), torch "
         f"{torch.__version__} ({torch.get_num_threads()} threads), ComfyUI {comfy_version()}, Python "
         f"{platform.python_version()}; {minutes:.1f} min. 1-min load average {load[0]:.1f} before, {load[1]:.1f} "
         f"at the end (this run included)."),
        "",
        f"SDXL shapes (× layers of that shape in the UNet, the weight of each in the times): {shapes}.",
        "",
        ("Times: seconds for all those layers (Σ count × one layer's time), medians over n repetitions ± half their "
         "range; ratio = ours/core of the medians, range = lowest and highest ratio of one repetition. Error rows: "
         "the pooled relative error, ratio = ours/core. 'within noise': the goal lies inside the range."),
        "",
    ]
    lines += table(rows, "core")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK} shapes of the subset")
    parser.add_argument("--shapes", choices=("subset", "all"), default="subset",
                        help="'all': every distinct SDXL UNet shape (long: the core's full SVD of the big convs)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, at least 3")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's). 1 keeps the SVDs honest on a shared machine: with "
                             "more threads than free cores, MKL's threads spin and LAPACK runs several times slower")
    parser.add_argument("--output", type=Path, default=None,
                        help="table file (default bench/results-tools.md; results-tools-quick.md for --quick)")
    opts = parser.parse_args(argv)
    if opts.repeats < 3:
        parser.error("--repeats: a spread needs at least 3 repetitions")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)  # the randomized SVD's test matrices
    load_before = os.getloadavg()[0]
    shapes = all_shapes() if opts.shapes == "all" else SUBSET[:QUICK] if opts.quick else SUBSET
    begin = datetime.now(timezone.utc)
    subset = layers(shapes)
    log(f"{len(subset)} shapes standing for {sum(la.count for la in subset)} SDXL layers, "
             f"{torch.get_num_threads()} threads, load average {load_before:.1f}")
    with tempfile.TemporaryDirectory(prefix="lycoris-bench-tools-") as tmp:
        rows = extract_rows(subset, opts.repeats)
        resized, cases = resize_rows(subset, opts.repeats, Path(tmp))
        rows += resized + dynamic_rows(subset, cases, opts.repeats)
    minutes = (datetime.now(timezone.utc) - begin).total_seconds() / 60
    args = " ".join(argv if argv is not None else sys.argv[1:])
    path = opts.output or BENCH / ("results-tools-quick.md" if opts.quick else "results-tools.md")
    write_table(rows, subset, f"python bench/tools.py {args}".strip(), minutes, (load_before, os.getloadavg()[0]),
                path)
    log(f"table written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
