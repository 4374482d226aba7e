"""Save LyCORIS: what a MODEL (and CLIP) carries relative to its base weights, as one file in the loras folder.

For every patched weight W₀ the applied change is ΔW = W − W₀, W being what loading the clone makes of it: ComfyUI's
merged patches (`patcher.patches[key]`, ours and any other, applied in order by ComfyUI's own calculate_weight), then
our bypass injections' chain (`.lycoris_entries`, in order, by the bypass form's own weight maths). `exact` writes
each ΔW in an exact form (lycoris_core/tools/combine.py: the module kept, LoRAs concatenated, or a full diff); `lora`
writes each as a LoRA/LoCon by SVD at a rank or error target. Every module's error is measured on the tensors as
written. Patches kept elsewhere (hooks: LyCORIS Hook, scheduled strengths) change during sampling: they are listed as
not written.
"""

import argparse
from dataclasses import dataclass, field

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import torch
from comfy_api.latest import io

from ...lycoris_core import LycorisError
from ...lycoris_core.block_weights import BlockWeights, parse
from ...lycoris_core.bypass import Contribution, changed_weight
from ...lycoris_core.tools.combine import (
    Entry,
    Written,
    concatenated,
    exact_module,
    is_concatenable,
    lora_module,
)
from ...lycoris_core.tools.metadata import ModuleRecord, tool_metadata
from ..glue.adapter import LycorisAdapter
from ..glue.apply import apply_file, sources_of
from ..glue.cache import load_cached
from ..glue.coverage import model_family
from ..glue.keymap import lora_key_map
from ..glue.object_params import REPLACES
from ..glue.patch_key import Offset
from ..glue.patched import base_weight
from ..glue.written_names import file_names
from .common import (
    CATEGORY,
    DTYPES,
    Progress,
    ToolReport,
    checkpoint,
    device,
    dtype_input,
    input_path,
    output_name_input,
    output_path,
    overwrite_input,
    report_outputs,
    write_file,
)

MODES = ("exact", "lora")
OTHER_PATCHES = "other patches"
HOOKED = ("applied by a hook (LyCORIS Hook, scheduled strengths): it changes during sampling, so it is no fixed "
          "change of the weights")
NO_NAME = "ComfyUI's key map has no module name for this weight"
NO_CHANGE = "its patches cancel out here: no change to write"


@dataclass
class Chain:
    """What acts on one weight, in order: ComfyUI's merged patch tuples, then our bypass contributions."""

    key: str
    merged: list = field(default_factory=list)
    bypassed: list[Contribution] = field(default_factory=list)
    replaced: torch.Tensor | None = None  # our object patch of a parameter ComfyUI's loading never patches

    @property
    def param(self) -> str:
        return "bias" if self.key.endswith(".bias") else "weight"

    def entries(self) -> list[Entry] | None:
        """The chain as our modules, or None when a patch in it is not one (another pack's or ComfyUI's adapter,
        a strength_model, a converter function, a window other than output rows): then only its dense change is
        known."""
        entries = []
        for strength_patch, adapter, strength_model, comfy_offset, function in self.merged:
            if not isinstance(adapter, LycorisAdapter) or strength_model != 1.0 or function is not None:
                return None
            offset = Offset.from_comfy(comfy_offset)
            if offset is not None and offset.dim != 0:
                return None
            rows = None if offset is None else (offset.start, offset.length)
            entries.append(Entry(adapter.plan, adapter.tensors, strength_patch, rows))
        return entries + [Entry(c.plan, c.tensors, c.strength, c.rows) for c in self.bypassed]

    @property
    def has_foreign(self) -> bool:
        return any(not isinstance(p[1], LycorisAdapter) for p in self.merged)


@dataclass
class Side:
    """One patcher (the MODEL, or the CLIP's) and the module names a file uses for its weights."""

    patcher: object
    names: dict[str, str]


def sides_of(model, clip) -> list[Side]:
    sides = []
    if model is not None:
        sides.append(Side(model, file_names(lora_key_map(model.model, is_clip=False))))
    if clip is not None:
        sides.append(Side(clip.patcher, file_names(lora_key_map(clip.cond_stage_model, is_clip=True))))
    return sides


def chains_of(patcher) -> dict[str, Chain]:
    chains: dict[str, Chain] = {}
    for key, patches in patcher.patches.items():
        if patches:
            chains.setdefault(key, Chain(key)).merged = list(patches)
    for injection in our_injections(patcher):
        for key, contribution in injection.lycoris_entries:
            chains.setdefault(key, Chain(key)).bypassed.append(contribution)
    for key, value in patcher.object_patches.items():
        if hasattr(value, REPLACES):  # glue/object_params.py: it holds every change of this parameter
            chains.setdefault(key, Chain(key)).replaced = value
    return chains


def original_of(replaced: torch.Tensor) -> torch.Tensor:
    """The parameter before any of our object patches (each one keeps the parameter it replaced)."""
    while hasattr(replaced, REPLACES):
        replaced = getattr(replaced, REPLACES)
    return replaced


def our_injections(patcher) -> list:
    return [i for injections in patcher.injections.values() for i in injections if hasattr(i, "lycoris_entries")]


def foreign_injections(patcher) -> list[str]:
    return [key for key, injections in patcher.injections.items()
            if any(not hasattr(i, "lycoris_entries") for i in injections)]


def hooked_keys(patcher) -> list[str]:
    return sorted({key for patches in patcher.hook_patches.values() for key in patches})


def applied_change(chain: Chain, w0: torch.Tensor) -> torch.Tensor:
    """W − W₀: the merged patches through ComfyUI's calculate_weight (as loading does), then the bypass chain (as
    patched.patched_weight, but for a chain already sorted into ours and others')."""
    if chain.replaced is not None:  # ComfyUI never applies merged patches to such a parameter: this is all of it
        return chain.replaced.to(w0.device, torch.float32) - w0
    weight = w0.clone()
    if chain.merged:
        weight = comfy.lora.calculate_weight(chain.merged, weight, chain.key, intermediate_dtype=torch.float32)
    if chain.bypassed:
        weight = changed_weight(weight, chain.bypassed)
    return weight.float() - w0


@dataclass(frozen=True)
class Settings:
    mode: str = "exact"
    rank: int = 32
    max_error: float = 0.0
    dtype: str = "fp16"

    def to_json(self) -> dict:
        return {"mode": self.mode, "dtype": self.dtype,
                **({"rank": self.rank, "max_error": self.max_error} if self.mode == "lora" else {})}


def module_for(chain: Chain, w0: torch.Tensor, delta: torch.Tensor, settings: Settings) -> Written:
    entries = chain.entries()
    dtype = DTYPES[settings.dtype]
    if settings.mode == "exact":
        return exact_module(entries, delta, w0, chain.param, dtype)
    factors = None
    if entries is not None and chain.param == "weight" and delta.ndim >= 2:
        factors = concatenated(entries, w0) if is_concatenable(entries, chain.param) else None
    return lora_module(delta, factors, w0, chain.param, settings.rank, settings.max_error, dtype)


def record_key(name: str, param: str) -> str:
    return name if param == "weight" else f"{name}.bias"


def collect(sides: list[Side], settings: Settings, report: ToolReport) -> dict[str, torch.Tensor]:
    """Every patched weight's module, computed before anything is written."""
    chains = [(side, chain) for side in sides for chain in chains_of(side.patcher).values()]
    for side in sides:
        report.not_written += [(key, HOOKED) for key in hooked_keys(side.patcher)]
        report.notes += [f"injection '{key}' is not ours: its change is not written" for key in
                         foreign_injections(side.patcher)]
    if not chains:
        hooks = " (only hooks, which change during sampling)" if report.not_written else ""
        raise LycorisError(f"nothing to save: this model carries no patches{hooks}")
    progress = Progress(len(chains))
    at = device()
    tensors: dict[str, torch.Tensor] = {}
    for side, chain in chains:
        weight_key = chain.key if chain.param == "weight" else chain.key[: -len("bias")] + "weight"
        name = side.names.get(weight_key)
        if name is None:
            report.not_written.append((chain.key, NO_NAME))
        else:
            _add_module(side, chain, name, at, settings, report, tensors)
        progress.step()
    if not tensors:
        raise LycorisError("nothing to save: no patched weight could be written (see the reasons listed)\n"
                           + report.text())
    return tensors


def _add_module(side: Side, chain: Chain, name: str, at: torch.device, settings: Settings, report: ToolReport,
                tensors: dict) -> None:
    w0 = (base_weight(side.patcher, chain.key, at) if chain.replaced is None
          else original_of(chain.replaced).to(at, torch.float32, copy=True))
    delta = applied_change(chain, w0)
    if not bool(delta.any()):
        report.not_written.append((chain.key, NO_CHANGE))
        return
    written = module_for(chain, w0, delta, settings)
    tensors.update({f"{name}.{suffix}": t.cpu() for suffix, t in written.tensors.items()})
    report.modules[record_key(name, chain.param)] = written.record


def sources(model, clip, has_foreign: bool) -> list[dict]:
    """The files our loaders applied (model side first, each once), then "other patches" for patches from
    elsewhere (ComfyUI's LoraLoader and other packs), whose files are not known."""
    seen, listed = set(), []
    for target in (model, clip):
        for source in sources_of(target) if target is not None else ():
            if source.get("id") not in seen:
                seen.add(source.get("id"))
                listed.append({k: v for k, v in source.items() if k != "id"})
    if has_foreign:
        listed.append({"file": OTHER_PATCHES,
                       "note": "patches not applied by LyCORIS Nodes (e.g. ComfyUI's LoraLoader): their change is "
                               "written, their files are not known"})
    return listed


def network_of(modules: dict[str, ModuleRecord]) -> tuple[str, str]:
    """(ss_network_module, algo): plain LoRA readers' values when every weight module is a LoRA (bias diffs ride
    along: ComfyUI's core loader and LyCORIS read `diff_b`)."""
    forms = {record.form.split(" ")[0] for key, record in modules.items() if not key.endswith(".bias")}
    if forms == {"lora"}:
        return "networks.lora", "lora"
    return "lycoris.kohya", "full" if forms == {"full"} else "mixed"


def save(model, clip, output_name: str, settings: Settings, overwrite: bool = False) -> ToolReport:
    if model is None and clip is None:
        raise LycorisError("connect a MODEL or a CLIP (or both): there is nothing to save")
    if settings.mode not in MODES or settings.dtype not in DTYPES:
        raise LycorisError(f"mode must be one of {MODES} and dtype one of {tuple(DTYPES)}")
    path = output_path(output_name)
    if path.exists() and not overwrite:
        raise LycorisError("a file of this name exists; choose another name or allow overwriting", file=str(path))
    report = ToolReport("Save LyCORIS")
    sides = sides_of(model, clip)
    with torch.no_grad():
        tensors = collect(sides, settings, report)
    has_foreign = any(chain.has_foreign for side in sides for chain in chains_of(side.patcher).values())
    listed = sources(model, clip, has_foreign)
    _notes(report, settings, listed)
    network_module, algo = network_of(report.modules)
    metadata = tool_metadata("LycorisSave", path.stem, model_family(model), report.modules, listed, network_module,
                             algo, settings.to_json())
    report.file = write_file(output_name, tensors, metadata, overwrite)
    return report


def _notes(report: ToolReport, settings: Settings, listed: list[dict]) -> None:
    names = ", ".join(s["file"] for s in listed) or "none recorded"
    report.notes.append(f"mode {settings.mode}, {settings.dtype}; sources: {names}")
    if settings.mode == "lora":
        full = sum(record.form == "full" for record in report.modules.values())
        if full:
            report.notes.append(f"{full} biases/norm weights have no LoRA form: written as full diffs")


class LycorisSave(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisSave",
            display_name="Save LyCORIS",
            category=CATEGORY,
            description=(
                "Writes what the MODEL and/or CLIP carry from LyCORIS/LoRA loaders (files, strengths, block weights, "
                "bypass or merged, ComfyUI's own LoRA loader too) as one .safetensors in the loras folder. 'exact' "
                "keeps each module exactly (LoRAs at any strengths concatenate; otherwise a full diff); 'lora' turns "
                "every change into a plain LoRA by SVD at a rank or error target. The report lists the form, rank "
                "and measured error of every module."
            ),
            is_output_node=True,
            inputs=[
                io.Model.Input("model", optional=True, tooltip="The patched diffusion model to save the changes of."),
                io.Clip.Input("clip", optional=True, tooltip="The patched text encoder to save the changes of."),
                output_name_input("lycoris/saved_stack"),
                io.Combo.Input("mode", options=list(MODES), default="exact",
                               tooltip="'exact': every change exactly (kept, LoRAs concatenated, else a full diff). "
                                       "'lora': every change as a plain LoRA by SVD (biases/norms stay full diffs)."),
                io.Int.Input("rank", default=32, min=1, max=4096,
                             tooltip="'lora' mode: the largest rank a module gets."),
                io.Float.Input("max_error", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="'lora' mode: the relative error to reach (|dW - LoRA| / |dW|): each module "
                                       "gets the smallest rank that reaches it, at most 'rank'. 0: always 'rank'."),
                dtype_input(),
                overwrite_input(),
            ],
            outputs=report_outputs(),
        )

    @classmethod
    def execute(cls, output_name, mode, rank, max_error, dtype, model=None, clip=None, overwrite=False):
        report = save(model, clip, output_name, Settings(mode, rank, max_error, dtype), overwrite)
        return report.node_output()


NODES: list[type[io.ComfyNode]] = [LycorisSave]


# --- command line ---------------------------------------------------------------------------------------------------

CLI_HELP = "Apply LoRA/LyCORIS files to a checkpoint (strengths, block weights) and save the result as one file."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint name in the checkpoints folder, or a path")
    parser.add_argument("--lora", action="append", required=True, metavar="FILE[:STRENGTH_MODEL[:STRENGTH_CLIP]]",
                        help="a file to apply (loras-folder name or path), in order; repeat for a stack")
    parser.add_argument("--block-weights", default="", help="block weights for every file (the Block Weights "
                        "node's text, e.g. 'default=1; output_blocks=0.5')")
    parser.add_argument("--mode", choices=MODES, default="exact")
    parser.add_argument("--rank", type=int, default=32, help="lora mode: the largest rank")
    parser.add_argument("--max-error", type=float, default=0.0, help="lora mode: relative error target (0: fixed rank)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("-o", "--output", required=True, help="output name in the loras folder")
    parser.add_argument("--overwrite", action="store_true")


def lora_spec(text: str) -> tuple[str, float, float]:
    """FILE[:strength_model[:strength_clip]]; the clip strength defaults to the model's, both to 1. Numbers are
    read from the right, so a Windows path's drive colon stays in the name."""
    parts, numbers = text.split(":"), []
    while len(parts) > 1 and len(numbers) < 2:
        try:
            numbers.insert(0, float(parts[-1]))
        except ValueError:
            break
        parts.pop()
    strength_model = numbers[0] if numbers else 1.0
    return ":".join(parts), strength_model, numbers[1] if len(numbers) > 1 else strength_model


def run_cli(args: argparse.Namespace) -> ToolReport:
    weights = parse(args.block_weights) if args.block_weights.strip() else BlockWeights()
    specs = [lora_spec(text) for text in args.lora]
    paths = [input_path("loras", name) for name, _, _ in specs]
    model, clip = checkpoint(args.checkpoint)
    for path, (_, strength_model, strength_clip) in zip(paths, specs):
        model, clip, _report = apply_file(load_cached(path), model, clip, strength_model, strength_clip, False,
                                          weights, "merge")
    return save(model, clip, args.output, Settings(args.mode, args.rank, args.max_error, args.dtype),
                args.overwrite)
