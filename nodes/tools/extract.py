"""Extract LyCORIS: a LoCon (or LoKr) file from the difference of a tuned MODEL (and CLIP) and its base, given as
another MODEL (and CLIP) or as a checkpoint file; the maths is lycoris_core/tools/extract.py.

A MODEL carrying patches (our loaders, ComfyUI's LoraLoader) counts with its patches applied (nodes/glue/patched.py).
A base checkpoint is loaded by ComfyUI's own loader (comfy.sd.load_checkpoint_guess_config, no VAE; its CLIP only
when a CLIP is given), so its keys are detected and converted exactly as when ComfyUI loads it, and they then match
the tuned model's keys one to one (a model of another architecture is refused, naming the first key that differs).
"""

import folder_paths
import torch
from comfy_api.latest import io

from ...lycoris_core import LycorisError
from ...lycoris_core.tools.extract import ALGOS, MODES, Extracted, extract_weight, rank_rule
from ...lycoris_core.tools.metadata import ModuleRecord, tool_metadata
from ..glue.coverage import model_family
from ..glue.keymap import lora_key_map
from ..glue.patched import patched_weight
from ..glue.written_names import file_names
from . import common
from .common import CATEGORY, Progress, ToolReport

NONE = "none"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MODE_TOOLTIP = "How the rank of each module is chosen (mode_param is what the mode reads):\n" + "\n".join(
    f"{mode}: {meaning}" for mode, meaning in MODES.items())
CLI_HELP = "extract a LoCon/LoKr file from the difference of a tuned checkpoint and its base"


# --- Sides: the tuned and base weights of one model part ----------------------------------------------------------

class Side:
    """One part (diffusion model or text encoder): tuned and base patchers, the weight keys to compare and the name
    each is written under (file_names over ComfyUI's key map)."""

    def __init__(self, label: str, tuned, base, is_clip: bool, base_name: str, config=None):
        self.label, self.tuned, self.base = label, tuned, base
        names = {k: n for k, n in file_names(lora_key_map(tuned.model, is_clip)).items()
                 if k.endswith(".weight")}  # a bias goes with its weight's module, as diff_b
        tuned_sd = tuned.model.state_dict()
        self.dropped = sorted(k for k in names if is_clip and k in tuned_sd and not_saved_text_weight(config, k, tuned_sd))
        names = {k: n for k, n in names.items() if k not in self.dropped}
        tuned_shapes = {k: tuple(v.shape) for k, v in tuned_sd.items()}
        base_shapes = {k: tuple(v.shape) for k, v in base.model.state_dict().items()}
        for key in names:
            if key not in tuned_shapes:
                continue
            if base_shapes.get(key) != tuned_shapes[key]:
                found = "missing" if key not in base_shapes else f"of shape {list(base_shapes[key])}"
                raise LycorisError(f"the base is not this model's architecture: its {label} weight is {found}, "
                                   f"the tuned one's is {list(tuned_shapes[key])}", file=base_name, key=key)
        self.names = {k: n for k, n in sorted(names.items()) if k in tuned_shapes}
        self.biases = {k: k[:-len(".weight")] + ".bias" for k in self.names if k.endswith(".weight")}
        self.biases = {k: b for k, b in self.biases.items() if b in tuned_shapes and b in base_shapes}

    def extract(self, key: str, options: dict, device: torch.device) -> Extracted:
        bias = self.biases.get(key) if options["bias"] else None
        return extract_weight(patched_weight(self.base, key, device), patched_weight(self.tuned, key, device),
                              options["rule"], options["algo"], options["dtype"], device, options["skip_below"],
                              options["factor"],
                              base_bias=None if bias is None else patched_weight(self.base, bias, device),
                              tuned_bias=None if bias is None else patched_weight(self.tuned, bias, device))


def not_saved_text_weight(config, key: str, state_dict: dict) -> bool:
    """A text-encoder weight ComfyUI's model config drops when it saves a checkpoint (SD1/SD2's unused
    text_projection, which it does not load either: its values are whatever memory held, different at every load)."""
    saving = getattr(config, "process_clip_state_dict_for_saving", None)
    if saving is None:
        return False
    return not saving({key: state_dict[key]})


def checkpoint_base(name: str, with_clip: bool):
    """(MODEL, CLIP or None) of a checkpoint in the checkpoints folder, by ComfyUI's own loader."""
    model, clip = common.checkpoint(name, with_clip)
    if with_clip and clip is None:
        raise LycorisError("this checkpoint holds no text encoder to compare the CLIP with", file=name)
    return model, clip


def sides(model, clip, model_base, clip_base, base_checkpoint: str) -> list[Side]:
    """The parts to compare, after checking that exactly one base is given and the CLIPs pair up."""
    has_checkpoint = bool(base_checkpoint) and base_checkpoint != NONE
    if (model_base is None) == (not has_checkpoint):
        raise LycorisError("give exactly one base: model_base (a MODEL) or base_checkpoint (a file), "
                           + ("not both" if has_checkpoint else "none was given"))
    if has_checkpoint:
        if clip_base is not None:
            raise LycorisError("with base_checkpoint the base text encoder is the checkpoint's: leave clip_base empty")
        model_base, clip_base = checkpoint_base(base_checkpoint, with_clip=clip is not None)
        base_name = base_checkpoint
    else:
        base_name = "model_base"
        if (clip is None) != (clip_base is None):
            raise LycorisError("give both clip and clip_base to extract the text encoder, or neither")
    parts = [Side("diffusion model", model, model_base, False, base_name)]
    if clip is not None:
        parts.append(Side("text encoder", clip.patcher, clip_base.patcher, True, base_name, model_config(model)))
    return parts


def model_config(model):
    return getattr(model.model, "model_config", None)


# --- The run ------------------------------------------------------------------------------------------------------

def extract_all(parts: list[Side], options: dict, device: torch.device
                ) -> tuple[dict[str, torch.Tensor], ToolReport, int]:
    """Every weight of every part: the tensors to write, the report, and how many weights did not change."""
    tensors: dict[str, torch.Tensor] = {}
    report = ToolReport("Extract LyCORIS")
    unchanged, worst_fit = 0, None
    progress = Progress(sum(len(p.names) for p in parts))
    for part in parts:
        for key, name in part.names.items():
            module = part.extract(key, options, device)
            progress.step()
            if module.form == "unchanged":
                unchanged += 1
            elif module.form == "skipped":
                report.not_written.append(
                    (name, f"relative change {module.change:.2e} below skip_below {options['skip_below']:g}"))
            else:
                # kept on the CPU until written: full diffs of a large model would not fit beside it on the GPU
                tensors.update({f"{name}.{suffix}": t.to("cpu") for suffix, t in module.tensors.items()})
                report.modules[name] = ModuleRecord(module.form, module.rank, module.error)
                if module.fit_error is not None:
                    worst_fit = max(worst_fit or 0.0, module.fit_error)
    if worst_fit is not None:
        report.notes.append(f"LoKr: largest error of the nearest Kronecker product alone {worst_fit:.2e}")
    return tensors, report, unchanged


def options_from(mode: str, mode_param: float, max_rank: int, algo: str, skip_below: float, save_dtype: str,
                 bias: bool, lokr_factor: int) -> dict:
    if algo not in ALGOS:
        raise LycorisError(f"unknown algo '{algo}'; one of {', '.join(ALGOS)}")
    if save_dtype not in DTYPES:
        raise LycorisError(f"unknown save dtype '{save_dtype}'; one of {', '.join(DTYPES)}")
    if skip_below < 0:
        raise LycorisError(f"skip_below must be 0 or more, got {skip_below}")
    try:
        rule = rank_rule(mode, mode_param, max_rank if max_rank > 0 else None)
    except ValueError as e:
        raise LycorisError(str(e)) from e
    return {"rule": rule, "algo": algo, "dtype": DTYPES[save_dtype], "skip_below": skip_below, "bias": bias,
            "factor": lokr_factor, "settings": {"mode": mode, "mode_param": mode_param, "max_rank": max_rank,
                                                "algo": algo, "skip_below": skip_below, "dtype": save_dtype,
                                                "bias": bias, "lokr_factor": lokr_factor}}


def check_output(output_name: str, overwrite: bool) -> None:
    """A bad or taken output name fails before any weight is read, not after the work (the writer checks again)."""
    path = common.output_path(output_name)
    if path.exists() and not overwrite:
        raise LycorisError("a file of this name exists; choose another name or allow overwriting", file=str(path))


def run(parts: list[Side], options: dict, output_name: str, overwrite: bool, family: str | None,
        sources: list[dict]) -> ToolReport:
    tensors, report, unchanged = extract_all(parts, options, common.device())
    if not tensors:
        raise LycorisError("nothing to write: the tuned weights equal the base's"
                           + (" or every change is below skip_below" if report.not_written else ""))
    forms = {r.form for r in report.modules.values()}
    plain = forms <= {"locon"} and not any(k.endswith(".diff_b") for k in tensors)
    metadata = tool_metadata("Extract LyCORIS", output_name, family, report.modules, sources,
                             "networks.lora" if plain else "lycoris.kohya",
                             options["algo"] if forms - {"full", "bias"} else "full", options["settings"])
    report.file = common.write_file(output_name, tensors, metadata, overwrite)
    dropped = [key for part in parts for key in part.dropped]
    if dropped:
        report.notes.append(f"not compared (ComfyUI neither loads nor saves them for this model): {', '.join(dropped)}")
    if unchanged:
        report.notes.append(f"{unchanged} weights are identical in both models (nothing to write for them)")
    return report


class LycorisExtract(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisExtract",
            display_name="Extract LyCORIS",
            category=CATEGORY,
            description="Writes a LoCon (or LoKr) file from the difference of a tuned model and its base: each "
                        "changed weight by SVD at the chosen rank rule, with the measured relative error per module.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The tuned diffusion model (with any patches it carries applied)."),
                io.Combo.Input("mode", options=list(MODES), default="fixed", tooltip=MODE_TOOLTIP),
                io.Float.Input("mode_param", default=32.0, min=0.0, max=100000.0, step=0.001,
                               tooltip="The mode's value: the rank for 'fixed', a singular value for 'threshold', "
                                       "a share 0-1 for 'ratio', 'quantile' and 'energy'; unused by 'full'."),
                io.Int.Input("max_rank", default=0, min=0, max=100000,
                             tooltip="Cap on the rank any rule picks (0: no cap). LyCORIS writes a module whose rank "
                                     "reaches half its output size as a full diff; a cap below that avoids it."),
                io.Combo.Input("algo", options=list(ALGOS), default="locon",
                               tooltip="locon: the best low-rank approximation (LoRA/LoCon). lokr: the nearest "
                                       "Kronecker product (exact for LoKr-shaped changes, coarse for others: see "
                                       "the reported error)."),
                io.Float.Input("skip_below", default=0.0, min=0.0, max=10.0, step=0.0001,
                               tooltip="Weights whose relative change |W1 - W0| / |W0| is below this are not "
                                       "written (listed in the report). 0 writes every changed weight."),
                common.dtype_input(),
                common.output_name_input("lycoris/extracted"),
                io.Model.Input("model_base", optional=True,
                               tooltip="The base diffusion model. Give this or base_checkpoint, not both."),
                io.Combo.Input("base_checkpoint", options=[NONE, *folder_paths.get_filename_list("checkpoints")],
                               default=NONE, optional=True,
                               tooltip="The base as a checkpoint file (loaded by ComfyUI's own loader, no VAE). "
                                       "Give this or model_base, not both."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The tuned text encoder: extract it too (needs clip_base or base_checkpoint)."),
                io.Clip.Input("clip_base", optional=True, tooltip="The base text encoder (with model_base)."),
                io.Boolean.Input("bias", default=True, optional=True,
                                 tooltip="Write bias changes as diff_b (exact) where the biases differ."),
                io.Int.Input("lokr_factor", default=-1, min=-1, max=4096, optional=True,
                             tooltip="LoKr only: LyCORIS' factor for splitting each dimension (-1: as square as "
                                     "possible)."),
                common.overwrite_input(),
            ],
            outputs=common.report_outputs(),
        )

    @classmethod
    def execute(cls, model, mode, mode_param, max_rank, algo, skip_below, dtype, output_name,
                model_base=None, base_checkpoint=NONE, clip=None, clip_base=None, bias=True, lokr_factor=-1,
                overwrite=False) -> io.NodeOutput:
        options = options_from(mode, mode_param, max_rank, algo, skip_below, dtype, bias, lokr_factor)
        check_output(output_name, overwrite)
        parts = sides(model, clip, model_base, clip_base, base_checkpoint)
        base = {"checkpoint": base_checkpoint} if model_base is None else {"model": "model_base input"}
        report = run(parts, options, output_name, overwrite, model_family(model), [{"role": "base", **base}])
        return report.node_output()


NODES = [LycorisExtract]


# --- Command line -------------------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--tuned", required=True, help="the tuned checkpoint (checkpoints-folder name or a path)")
    parser.add_argument("--base", required=True, help="the base checkpoint (checkpoints-folder name or a path)")
    parser.add_argument("--mode", choices=list(MODES), default="fixed", help="rank rule (default fixed)")
    parser.add_argument("--value", type=float, default=None, help="the mode's value (default: --rank for fixed)")
    parser.add_argument("--rank", type=int, default=32, help="rank for 'fixed'; a cap for the other modes "
                                                             "only when --max-rank is given")
    parser.add_argument("--max-rank", type=int, default=0, help="cap on any rule's rank (0: none)")
    parser.add_argument("--algo", choices=list(ALGOS), default="locon")
    parser.add_argument("--factor", type=int, default=-1, help="LoKr: LyCORIS' factor (-1: as square as possible)")
    parser.add_argument("--skip-below", type=float, default=0.0, help="skip weights whose relative change is below")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16", help="storage type (default fp16)")
    parser.add_argument("--no-text-encoder", action="store_true", help="extract the diffusion model only")
    parser.add_argument("--no-bias", action="store_true", help="do not write bias changes")
    parser.add_argument("-o", "--output", required=True, help="output name in the loras folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file of that name")


def run_cli(args) -> ToolReport:
    value = args.value if args.value is not None else (args.rank if args.mode == "fixed" else None)
    if value is None and args.mode != "full":
        raise LycorisError(f"mode '{args.mode}' needs --value")
    options = options_from(args.mode, value or 0.0, args.max_rank, args.algo, args.skip_below, args.dtype,
                           not args.no_bias, args.factor)
    check_output(args.output, args.overwrite)
    with_clip = not args.no_text_encoder
    tuned, tuned_clip = common.checkpoint(args.tuned, with_clip)
    base, base_clip = common.checkpoint(args.base, with_clip)
    parts = [Side("diffusion model", tuned, base, False, args.base)]
    if tuned_clip is not None and base_clip is not None:
        parts.append(Side("text encoder", tuned_clip.patcher, base_clip.patcher, True, args.base,
                          model_config(tuned)))
    sources = [{"role": "tuned", "checkpoint": args.tuned}, {"role": "base", "checkpoint": args.base}]
    return run(parts, options, args.output, args.overwrite, model_family(tuned), sources)
