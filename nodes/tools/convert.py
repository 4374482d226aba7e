"""Convert LyCORIS: a file's modules renamed between kohya/LyCORIS names and diffusers/PEFT names, exactly.

Names come from the model: every module is placed by the loader's own mapping (apply.map_file, ComfyUI's key map
extended with diffusers/PEFT names), and the weight it lands on is named in the target style (kohya: the name
every LoRA tool and ComfyUI's core loader read; diffusers: what save_lora_weights writes; glue/written_names.py).
The tensors are converted by lycoris_core/tools/convert.py. Every written module is then read back by the loader's
own parser and maths and compared with the source module's change: a module that does not reproduce it (relative
1e-5, fp32) is not written. What cannot be converted is reported per module with its reason, or, with
on_unconvertible = error, refuses the whole conversion.
"""

import os
from dataclasses import dataclass

import comfy.model_base
import comfy.sd
import comfy.utils
import torch
from comfy_api.latest import io

from ...lycoris_core import LycorisError, LycorisFile, parse_state_dict
from ...lycoris_core.tools import convert
from ...lycoris_core.tools.changes import module_change
from ...lycoris_core.tools.metadata import ModuleRecord, tool_metadata
from ..glue.apply import map_file
from ..glue.cache import load_cached
from ..glue.coverage import Applied, model_family
from ..glue.inputs import lycoris_input, lycoris_path
from ..glue.keymap import TRAINED_ON, TRAINED_ON_COMFY, TRAINED_ON_ORIGINAL, TRAINED_ON_UNKNOWN, lora_key_map
from ..glue.lora_files import validate_name
from ..glue.patch_key import Offset
from ..glue.written_names import RowPart, diffusers_names, file_names, for_flux_generation, part_names
from .common import (
    CATEGORY,
    Progress,
    ToolReport,
    checkpoint,
    device,
    input_path,
    output_name_input,
    overwrite_input,
    report_outputs,
    write_file,
)

TOOL = "Convert LyCORIS"
REPORT, ERROR = "report and leave out", "error"
DTYPES = {"keep": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EXACT = 1e-5  # a converted module's change may differ from the source's by this much (fp32 rounding) at most
FUSED_PART = ("changes part of a fused weight (rows {offset} of {key}): the {target} names give only the whole "
              "weight")
ONE_NAME = "another module of the file already changes this weight ({other}); a file holds one module per weight"


@dataclass
class Planned:
    """One module on its way out: its output name, converted form, and where it acts in the model."""

    source_key: str
    name: str
    converted: convert.Converted
    applied: Applied
    rows: tuple[int, int] | None = None  # (start, length): this part of a fused weight's change (diffusers' names)
    joined: tuple[Applied, ...] = ()  # kohya: the modules on row parts of one fused weight, written as one


# --- the model's side: names, weights ----------------------------------------------------------------------------

def key_map_of(model, clip) -> dict:
    key_map = {}
    if model is not None:
        key_map.update(lora_key_map(model.model, is_clip=False))
    if clip is not None:
        key_map.update(lora_key_map(clip.cond_stage_model, is_clip=True))
    return key_map


def is_flux2(model) -> bool:
    flux2 = getattr(comfy.model_base, "Flux2", None)
    return model is not None and flux2 is not None and isinstance(model.model, flux2)


def weight_of(applied: Applied, model, clip) -> torch.Tensor:
    """The model's weight a module changes (its rows, for an offset target): read directly (a state_dict() per
    module would list the whole model each time)."""
    module = model.model if applied.target.side == "model" else clip.cond_stage_model
    weight = comfy.utils.get_attr(module, applied.target.key).detach()
    offset = applied.target.offset
    return weight if offset is None else weight.narrow(offset.dim, offset.start, offset.length)


def weight_key(applied: Applied) -> str:
    """The weight whose name a module takes: a bias part (LyCORIS' diff_b) sits with its layer's weight."""
    key = applied.target.key
    return key[: -len(".bias")] + ".weight" if applied.module.param == "bias" else key


# --- converting ---------------------------------------------------------------------------------------------------

def convert_module(applied: Applied, target: str, weight: torch.Tensor) -> convert.Converted | str:
    shape = tuple(applied.target.shape)
    if target == convert.KOHYA:
        return convert.to_kohya(applied.module, applied.plan, shape)
    return convert.to_peft(applied.module, applied.plan, shape, weight, device())


def plan_modules(lfile: LycorisFile, model, clip, target: str, trained_on: str = TRAINED_ON_UNKNOWN
                 ) -> tuple[list[Planned], list[tuple[str, str]]]:
    """Every module of the file either planned under its target name or listed with the reason it is not."""
    _patches, mapped = map_file(lfile, model, clip, reference=False, trained_on=trained_on)
    key_map = key_map_of(model, clip)
    if target == convert.DIFFUSERS:
        key_map = for_flux_generation(key_map, is_flux2(model))
    names = file_names(key_map) if target == convert.KOHYA else diffusers_names(key_map)
    refused = list(mapped.problems) + list(mapped.harmless) + list(mapped.unused_keys)  # none is written
    planned: list[Planned] = []
    taken: dict[tuple[str, str], str] = {}  # (name, parameter) -> the module key that took it
    progress = Progress(len(mapped.targets))
    parts = part_names(key_map) if target == convert.DIFFUSERS else {}
    fused: dict[str, list[tuple[str, Applied]]] = {}  # kohya: weight key -> the modules on its row parts
    for module_key, applied in mapped.targets.items():
        progress.step()
        if applied.target.offset is None and weight_key(applied) not in names and weight_key(applied) in parts:
            reason = _plan_parts(module_key, applied, parts[weight_key(applied)], model, clip, planned, taken)
            if reason is not None:
                refused.append((module_key, reason))
            continue
        if target == convert.KOHYA and _is_row_part(applied) and weight_key(applied) in names:
            fused.setdefault(weight_key(applied), []).append((module_key, applied))
            continue
        reason = _name_problem(applied, names, target)
        name = names.get(weight_key(applied))
        if reason is None and (name, applied.module.param) in taken:
            reason = ONE_NAME.format(other=taken[name, applied.module.param])
        if reason is None:
            result = convert_module(applied, target, weight_of(applied, model, clip))
            if isinstance(result, str):
                reason = result
            else:
                taken[name, applied.module.param] = module_key
                planned.append(Planned(module_key, name, result, applied))
        if reason is not None:
            refused.append((module_key, reason))
    for key, members in fused.items():
        reason = _join_parts(key, members, names[key], model, planned, taken)
        refused += [(module_key, reason) for module_key, _a in members] if reason is not None else []
    return planned, refused


def _is_row_part(applied: Applied) -> bool:
    """A module on rows of a diffusion-model weight, with no ComfyUI converter function in between."""
    target = applied.target
    return target.side == "model" and target.offset is not None and target.patch_key.output_rows_only


def _join_parts(key: str, members: list[tuple[str, Applied]], name: str, model, planned: list[Planned],
                taken: dict) -> str | None:
    """kohya: the modules on row parts of one fused weight (diffusers' to_q/to_k/to_v of Flux's qkv) as one LoRA
    on the whole weight (convert.join_rows: block rows, ranks side by side, exact)."""
    if (name, "weight") in taken:
        return ONE_NAME.format(other=taken[name, "weight"])
    weight = comfy.utils.get_attr(model.model, key).detach()
    pieces = []
    for _module_key, applied in members:
        if not convert.is_factored(applied.plan):
            return (f"{applied.module.label} on part of the fused weight {key}: joining parts into kohya's one "
                    f"weight needs each part's change as a low-rank product (not DoRA, OFT, ...)")
        start, length = applied.target.offset.start, applied.target.offset.length
        change = module_change(applied.plan, applied.module.tensors, 1.0, weight.narrow(0, start, length), device())
        pieces.append((start, change))
    joined = convert.join_rows(pieces, tuple(weight.shape))
    if isinstance(joined, str):
        return joined
    first_key, first = members[0]
    taken[name, "weight"] = first_key
    planned.append(Planned(first_key, name, joined, first, joined=tuple(a for _k, a in members)))
    return None


def _plan_parts(module_key: str, applied: Applied, parts: list[RowPart], model, clip,
                planned: list[Planned], taken: dict) -> str | None:
    """A module on a weight diffusers splits (Flux's qkv into to_q/to_k/to_v): one LoRA per part, its lora_B
    rows (and DoRA magnitude rows) the part's rows, lora_A shared. ΔW's rows are exactly up's rows times down,
    and DoRA normalises each output row on its own, so the parts together are the module exactly."""
    covered = sum(part.length for part in parts)
    if covered != applied.target.shape[0]:
        return (f"diffusers names cover rows 0..{covered} of {applied.target.key}, which has "
                f"{applied.target.shape[0]}: the rest could not be written")
    param = applied.module.param
    taken_by = [taken[part.name, param] for part in parts if (part.name, param) in taken]
    if taken_by:
        return ONE_NAME.format(other=taken_by[0])
    result = convert_module(applied, convert.DIFFUSERS, weight_of(applied, model, clip))
    if isinstance(result, str):
        return result
    for part in parts:
        taken[part.name, param] = module_key
        planned.append(Planned(module_key, part.name, convert.row_part(result, part.start, part.length), applied,
                               (part.start, part.length)))
    return None


def source_change(p: Planned, model, clip) -> "torch.Tensor | convert.Factors":
    """The source module's full-strength change, only the planned part's rows for a split module, the parts'
    changes in their rows of the whole weight for joined ones."""
    if p.joined:
        weight = comfy.utils.get_attr(model.model, p.applied.target.key).detach()
        whole = torch.zeros(weight.shape[0], weight[0].numel(), dtype=torch.float32, device=device())
        for applied in p.joined:
            start, length = applied.target.offset.start, applied.target.offset.length
            change = module_change(applied.plan, applied.module.tensors, 1.0, weight.narrow(0, start, length),
                                   device())
            dense = change.dense() if isinstance(change, convert.Factors) else change
            whole[start:start + length] = dense.reshape(length, -1)
        return whole
    change = module_change(p.applied.plan, p.applied.module.tensors, 1.0, weight_of(p.applied, model, clip), device())
    return change if p.rows is None else convert.rows_of(change, *p.rows)


def part_weight(p: Planned, model, clip) -> torch.Tensor:
    if p.joined:
        return comfy.utils.get_attr(model.model, p.applied.target.key).detach()
    weight = weight_of(p.applied, model, clip)
    return weight if p.rows is None else weight.narrow(0, p.rows[0], p.rows[1])


def _component(name: str) -> str:
    found = convert.component_path(name)
    return found[0] if found else ""


def complete_dora(planned: list[Planned], model, clip) -> list[Planned]:
    """diffusers: in a component where some modules carry DoRA, PEFT applies DoRA to all (one `use_dora` per
    config); the others get the magnitude that leaves their change a plain LoRA's (convert.with_identity_magnitude)."""
    with_dora = {_component(p.name) for p in planned if convert.PEFT_MAGNITUDE in p.converted.tensors}
    done = []
    for p in planned:
        if _component(p.name) in with_dora and convert.PEFT_MAGNITUDE not in p.converted.tensors:
            weight = part_weight(p, model, clip)
            magnitude = convert.with_identity_magnitude(p.converted, source_change(p, model, clip), weight,
                                                        tuple(weight.shape))
            p = Planned(p.source_key, p.name, magnitude, p.applied, p.rows)
        done.append(p)
    return done


def _name_problem(applied: Applied, names: dict[str, str], target: str) -> str | None:
    style = "kohya" if target == convert.KOHYA else "diffusers/PEFT"
    if applied.target.offset is not None:
        return FUSED_PART.format(offset=list(applied.target.offset.as_comfy()), key=applied.target.key, target=style)
    if weight_key(applied) not in names:
        return f"this model's key map has no {style} name for {weight_key(applied)}"
    return None


def _output_tensors(planned: list[Planned], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`keep` (None) keeps each module's stored dtype; computed factors (a Tucker fold) are cast to it."""
    tensors = {}
    for p in planned:
        keep = next(iter(p.applied.module.tensors.values())).dtype
        for suffix, tensor in convert.cast(p.converted.tensors, dtype or keep).items():
            tensors[f"{p.name}.{suffix}"] = tensor
    return tensors


def _peft_metadata(planned: list[Planned]) -> dict[str, str]:
    return convert.peft_metadata({p.name: p.converted for p in planned})


@dataclass(frozen=True)
class Difference:
    """How far a written module's change is from the source's: relative to the change, and to the weight."""

    of_change: float
    of_weight: float
    dora: bool  # either side normalises by norm(W + dW) (LyCORIS with eps = finfo.eps, PEFT without)

    def exact(self) -> bool:
        """Within fp32 rounding. DoRA's ε in the norm (LyCORIS', our loader's; PEFT has none) moves W' by
        ε·‖W'‖ ≈ 1e-7 of the weight, whatever the change's size: for DoRA, that is the yardstick."""
        return self.of_change <= EXACT or (self.dora and self.of_weight <= EXACT)


def differences(planned: list[Planned], tensors: dict, metadata: dict, model, clip, name: str
                ) -> dict[str, Difference | str]:
    """Source module key -> how far the written module's change (read back by our own parser and maths, placed by
    the key map) is from the source module's; a string when it does not read back to that weight."""
    parsed = parse_state_dict(tensors, name, metadata)
    _p, mapped = map_file(parsed, model, clip, reference=False)
    by_name = {(a.module.prefix, a.module.param): a for a in mapped.targets.values()}
    found: dict[str, Difference | str] = {}
    for p in planned:
        back = by_name.get((p.name, written_param(p.applied)))
        rows = None if p.rows is None else Offset(0, *p.rows)
        if p.joined:
            rows = None
        elif p.rows is None and p.applied.target.offset is not None:
            rows = p.applied.target.offset
        if back is None or back.target.key != p.applied.target.key or back.target.offset != rows:
            found[_check_key(p)] = "the written module does not read back onto the same weight"
            continue
        weight = part_weight(p, model, clip)
        source = source_change(p, model, clip)
        written = module_change(back.plan, back.module.tensors, 1.0, weight, device())
        of_change = convert.relative_difference(source, written)
        weight_norm = float(weight.double().norm())
        of_weight = of_change * convert.change_norm(source) / weight_norm if weight_norm > 0 else of_change
        found[_check_key(p)] = Difference(of_change, of_weight,
                                          p.applied.plan.dora_axis is not None or back.plan.dora_axis is not None)
    return found


def written_param(applied: Applied) -> str:
    """The parameter a written module's suffixes name: a part named after its layer's other parameter (LightX2V's
    `diff_m` on `modulation`) is written on that parameter's own name as a `.diff` (convert.to_kohya)."""
    return applied.module.param if applied.module.param in ("weight", "bias") else "weight"


def _check_key(p: Planned) -> str:
    """One check per written module: a split module's parts are checked one by one."""
    return p.source_key if p.rows is None else f"{p.source_key} (rows {p.rows[0]}..{sum(p.rows)})"


def _checked(planned: list[Planned], model, clip, target: str, name: str) -> tuple[list[Planned], list]:
    """The planned modules whose maths reproduces the source (checked before any rounding to the save dtype)."""
    tensors = _output_tensors(planned, torch.float32)
    metadata = _peft_metadata(planned) if target == convert.DIFFUSERS and planned else {}
    found = differences(planned, tensors, metadata, model, clip, name) if planned else {}
    failed = {}
    for p in planned:
        difference = found[_check_key(p)]
        if isinstance(difference, str) or not difference.exact():
            detail = difference if isinstance(difference, str) else f"relative difference {difference.of_change:.2e}"
            failed.setdefault(p.source_key, f"the converted module does not reproduce the change ({detail})")
    kept = [p for p in planned if p.source_key not in failed]  # a split module is written whole or not at all
    refused = []
    for p in planned:
        if p.source_key in failed:
            keys = [p.source_key] + [a.module.prefix + "." + a.module.param for a in p.joined[1:]]
            refused += [(key, failed[p.source_key]) for key in keys if key not in dict(refused)]
    return kept, refused


@dataclass
class Conversion:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, object]
    report: ToolReport


def conversion(lfile: LycorisFile, model, clip, target: str, on_unconvertible: str, dtype_name: str,
               title: str, trained_on: str = TRAINED_ON_UNKNOWN) -> Conversion:
    """The converted file (tensors + metadata) and its report; LycorisError when nothing converts or when
    `on_unconvertible` is `error` and something does not."""
    if target not in convert.TARGETS:
        raise LycorisError(f"unknown target '{target}' (kohya or diffusers)")
    if dtype_name not in DTYPES:
        raise LycorisError(f"unknown save dtype '{dtype_name}' ({', '.join(DTYPES)})")
    if trained_on not in TRAINED_ON:
        raise LycorisError(f"unknown trained_on '{trained_on}' ({'; '.join(TRAINED_ON)})")
    planned, refused = plan_modules(lfile, model, clip, target, trained_on)
    if target == convert.DIFFUSERS:
        planned = complete_dora(planned, model, clip)
    planned, failed = _checked(planned, model, clip, target, lfile.name)
    refused += failed
    if refused and on_unconvertible == ERROR:
        key, reason = refused[0]
        raise LycorisError(f"{len(refused)} modules cannot be converted to {target} exactly, e.g. {reason}",
                           file=lfile.name, key=key)
    if not planned:
        detail = f": {refused[0][0]}: {refused[0][1]}" if refused else ""
        raise LycorisError(f"no module converts to {target}{detail}", file=lfile.name)
    tensors = _output_tensors(planned, DTYPES[dtype_name])
    stored = _peft_metadata(planned) if target == convert.DIFFUSERS else {}
    errors = differences(planned, tensors, stored, model, clip, lfile.name)
    records = {p.name: ModuleRecord(p.converted.form, p.converted.rank, _recorded(errors[_check_key(p)]))
               for p in planned}
    metadata = _metadata(lfile, model, target, title, records, refused, stored)
    report = ToolReport(TOOL, modules=records, not_written=refused, notes=_notes(planned, target, dtype_name))
    return Conversion(tensors, metadata, report)


def _recorded(difference: "Difference | str") -> float:
    return 1.0 if isinstance(difference, str) else difference.of_change


def _notes(planned: list[Planned], target: str, dtype_name: str) -> list[str]:
    forms = sorted({p.converted.form for p in planned})
    notes = [f"converted to {target} names: {', '.join(forms)}"]
    if any("Tucker" in f for f in forms):
        notes.append("Tucker (lora_mid) has no PEFT form: folded into lora_A, an exact LoCon of the same rank")
    if target == convert.KOHYA and any("dora" in f for f in forms):
        notes.append("DoRA is written as LyCORIS' out-axis dora_scale: our loader reads it exactly; ComfyUI's core "
                     "loader normalises the out-axis by W instead of W + dW and differs")
    if any("unchanged" in f for f in forms):
        notes.append("PEFT's use_dora covers a whole component: its plain LoRA modules carry the magnitude "
                     "norm(W + dW), which leaves them plain (within DoRA's epsilon, about 1e-7 of W)")
    if dtype_name != "keep":
        notes.append(f"saved in {dtype_name}: the error per module is that rounding")
    return notes


def _metadata(lfile: LycorisFile, model, target: str, title: str, records: dict, refused: list,
              peft: dict) -> dict[str, object]:
    family = model_family(model) or lfile.metadata.get("ss_base_model_version")
    forms = {r.form for r in records.values()}
    plain = target == convert.DIFFUSERS or all(f.startswith(("locon", "lora")) for f in forms)
    metadata = tool_metadata(TOOL, title, family, records, [{"file": lfile.name}],
                             "networks.lora" if plain else "lycoris.kohya", "lora" if plain else "mixed",
                             {"target": target, "not_written": {k: r for k, r in refused}})
    metadata.update(peft)
    return metadata


# --- the node ------------------------------------------------------------------------------------------------------

def run(lycoris_path_: str, model, clip, target: str, on_unconvertible: str, save_dtype: str, output_name: str,
        overwrite: bool, trained_on: str = TRAINED_ON_UNKNOWN) -> ToolReport:
    lfile = load_cached(lycoris_path_)
    title = os.path.splitext(os.path.basename(output_name.strip()))[0] or "converted"
    result = conversion(lfile, model, clip, target, on_unconvertible, save_dtype, title, trained_on)
    result.report.file = write_file(output_name, result.tensors, result.metadata, overwrite)
    return result.report


class LycorisConvert(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisConvert",
            display_name="Convert LyCORIS",
            category=CATEGORY,
            description=(
                "Writes a LyCORIS/LoRA file under kohya/LyCORIS names or under diffusers/PEFT names, exactly: the "
                "model says which weight each module changes and what that weight is called. What the other side "
                "cannot hold is listed with its reason, never dropped silently."),
            is_output_node=True,
            inputs=[
                lycoris_input(),
                io.Combo.Input("target", options=list(convert.TARGETS), default=convert.DIFFUSERS,
                               tooltip="kohya: lora_unet_/lora_te_ names with alpha (ComfyUI's core loader, A1111, "
                                       "kohya's scripts). diffusers: unet./transformer./text_encoder. names with "
                                       "lora_A/lora_B and the PEFT config in the metadata (diffusers, PEFT)."),
                io.Model.Input("model", tooltip="The model the file is for: it gives each module's weight and name."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The text encoder the file is for; without it, text-encoder modules are "
                                      "reported, not written."),
                io.Combo.Input("on_unconvertible", options=[REPORT, ERROR], default=REPORT, optional=True,
                               tooltip="A module the target cannot hold exactly: leave it out and list it with the "
                                       "reason, or refuse the whole conversion."),
                io.Combo.Input("dtype", options=list(DTYPES), default="keep", optional=True,
                               tooltip="keep: each tensor's own dtype (exact). fp16/bf16/fp32: cast (the rounding "
                                       "is reported per module)."),
                output_name_input("lycoris/converted"),
                overwrite_input(),
                # last: a saved workflow gives widget values by position, so a new input goes after the old ones
                io.Combo.Input("trained_on", options=list(TRAINED_ON), default=TRAINED_ON_UNKNOWN, optional=True,
                               tooltip="Only for files whose rows depend on the checkpoint they were trained on and "
                                       "do not say which (DiffSynth-Studio's MiniMax H3 qkv_proj: MiniMax's original "
                                       "checkpoint reads them per head, Comfy-Org's as ComfyUI does). The written "
                                       "file holds ComfyUI's rows and loads anywhere."),
            ],
            outputs=report_outputs(),
        )

    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, lycoris_name, target, model, clip=None, on_unconvertible=REPORT, dtype="keep",
                output_name="lycoris/converted", overwrite=False, trained_on=TRAINED_ON_UNKNOWN) -> io.NodeOutput:
        report = run(lycoris_path(lycoris_name), model, clip, target, on_unconvertible, dtype, output_name,
                     overwrite, trained_on)
        return report.node_output()


NODES: list[type[io.ComfyNode]] = [LycorisConvert]


# --- the command line ----------------------------------------------------------------------------------------------

CLI_TRAINED_ON = {"unknown": TRAINED_ON_UNKNOWN, "comfy": TRAINED_ON_COMFY, "original": TRAINED_ON_ORIGINAL}
CLI_HELP = "convert a file between kohya/LyCORIS names and diffusers/PEFT names, exactly (needs the checkpoint)"


def add_arguments(parser) -> None:
    parser.add_argument("file", help="the LyCORIS/LoRA file: a name in the loras folder or a path")
    parser.add_argument("--to", required=True, choices=convert.TARGETS, dest="target", help="the names to write")
    parser.add_argument("--checkpoint", required=True,
                        help="the model the file is for (a name in the checkpoints folder or a path): its weights "
                             "name the modules")
    parser.add_argument("--diffusion-model-only", action="store_true",
                        help="the --checkpoint is a diffusion model alone (ComfyUI's diffusion_models / unet folder, "
                             "e.g. a Flux transformer): text-encoder modules are then reported, not written")
    parser.add_argument("-o", "--output", required=True, help="output name in the loras folder")
    parser.add_argument("--on-unconvertible", choices=[REPORT, ERROR], default=REPORT)
    parser.add_argument("--dtype", choices=list(DTYPES), default="keep", help="keep: each tensor in its own dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--trained-on", choices=["unknown", "comfy", "original"], default="unknown",
                        help="for a file whose rows depend on the checkpoint it was trained on and that does not say "
                             "which (DiffSynth-Studio's MiniMax H3): Comfy-Org's (ComfyUI's rows) or the original")


def run_cli(args) -> ToolReport:
    if args.diffusion_model_only:
        model, clip = comfy.sd.load_diffusion_model(input_path("diffusion_models", args.checkpoint)), None
    else:
        model, clip = checkpoint(args.checkpoint)
    return run(input_path("loras", args.file), model, clip, args.target, args.on_unconvertible, args.dtype,
               args.output, args.overwrite, CLI_TRAINED_ON[args.trained_on])
