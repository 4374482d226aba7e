"""Resize LyCORIS: a file's modules, any algorithm, as plain LoRA/LoCon of a new rank (lycoris_core/tools/resize.py),
written under the file's own module names, so the result loads wherever the input did.

Changes that read the base weight (DoRA, OFT, BOFT, (IA)³, GLoRA) need it: MODEL/CLIP give it (the file is mapped onto
them as the loader maps it). Without them such modules are an error by default, or left out and listed.
"""

import argparse
import functools
from collections.abc import Mapping

from comfy_api.latest import io

from ...lycoris_core import LycorisError, LycorisFile
from ...lycoris_core.tools import resize
from ...lycoris_core.tools.lowrank import RULES
from ...lycoris_core.tools.metadata import tool_metadata
from ..glue.apply import map_file
from ..glue.cache import load_cached
from ..glue.coverage import model_family
from ..glue.inputs import fingerprint_by_file, lycoris_input, lycoris_path
from ..glue.lora_files import validate_name
from ..glue.report import _weight_fp32
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

TOOL = "LycorisResize"
ERROR, SKIP = "error", "skip-and-report"
RULE_TOOLTIP = ("How each module's rank is chosen from its singular values s1 >= s2 >= ... fixed: 'rank' itself. "
                "kohya's resize_lora (--dynamic_method): sv_ratio keeps s >= s1/value (value >= 1); sv_cumulative "
                "keeps s until their running sum reaches 'value' of the total; sv_fro keeps the rank whose Frobenius "
                "norm reaches 'value' of the change's. LyCORIS' extractor: threshold keeps s > value; ratio keeps "
                "s > value*s1; quantile keeps s until their running sum reaches 'value'. Dynamic rules are capped "
                "at 'rank'.")


def module_bases(lfile: LycorisFile, model, clip) -> dict[str, resize.Base]:
    """Each module's target weight in MODEL/CLIP (mapped as the loader maps the file): its shape, and how to fetch
    its unpatched fp32 values for changes that read them (one module at a time, when its turn comes)."""
    if model is None and clip is None:
        return {}
    _patches, report = map_file(lfile, model, clip, reference=False)
    patchers = {"model": model, "clip": None if clip is None else clip.patcher}
    bases = {}
    for key, applied in report.targets.items():
        fetch = (functools.partial(_weight_fp32, patchers[applied.target.side], applied)
                 if resize.needs_base(applied.module, applied.plan) else None)
        bases[key] = resize.Base(tuple(applied.target.shape), fetch=fetch)
    return bases


def missing_error(lfile: LycorisFile, missing: list[tuple[str, str]]) -> LycorisError:
    labels = sorted({reason.split(":")[0] for _, reason in missing})
    examples = ", ".join(key for key, _ in missing[:3])
    return LycorisError(
        f"{len(missing)} modules ({', '.join(labels)}) change the weight in a way that depends on the weight "
        f"itself: connect the MODEL (and CLIP) the file is for, or set on_missing_base to '{SKIP}' to leave them "
        f"out. First: {examples}", file=lfile.name)


def run(path: str, model, clip, settings: resize.Settings, on_missing_base: str, output_name: str,
        overwrite: bool, rule_text: str) -> ToolReport:
    target = output_path(output_name)  # a bad name, or an existing file, is refused before any maths
    if target.exists() and not overwrite:
        raise LycorisError("a file of this name exists; choose another name or allow overwriting", file=str(target))
    lfile = load_cached(path)
    bases = module_bases(lfile, model, clip)
    missing = resize.missing_base(lfile, bases, have_model=model is not None or clip is not None)
    if missing and on_missing_base != SKIP:
        raise missing_error(lfile, missing)
    progress = Progress(len(lfile.modules))
    result = resize.resize_file(lfile, bases, settings, device(), skip=dict(missing), step=progress.step)
    report = ToolReport(TOOL, modules=result.modules, not_written=result.not_written)
    if not result.tensors:
        raise LycorisError("nothing to write: every module was left out", file=lfile.name)
    family = model_family(model) or lfile.metadata.get("ss_base_model_version")
    title = output_name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".safetensors")
    metadata = tool_metadata(TOOL, title, family, result.modules, [{"file": lfile.name}], "networks.lora", "locon",
                             {"rule": rule_text, "dtype": str(settings.dtype).removeprefix("torch."),
                              "tucker": settings.tucker})
    report.file = write_file(output_name, result.tensors, metadata, overwrite)
    # What was asked; the ranks written are in the report's first line (a module keeps a lower rank of its own).
    report.notes.append(f"asked: {rule_text}, {str(settings.dtype).removeprefix('torch.')}; source: {lfile.name}")
    report.notes.append(forms_line(result.modules))
    if result.shape_from_file:
        report.notes.append(
            f"{len(result.shape_from_file)} modules were written flat (out, in x kernel): the file does not record "
            "their layer's kernel shape and no MODEL/CLIP gives it (ComfyUI and this pack read them the same; "
            "connect MODEL/CLIP for conv-shaped tensors and Tucker)")
    return report


def forms_line(records: Mapping[str, resize.ModuleRecord]) -> str:
    counts: dict[str, int] = {}
    for record in records.values():
        counts[record.form] = counts.get(record.form, 0) + 1
    described = {"lora": "LoRA", "locon": "LoCon", "locon-tucker": "LoCon Tucker (fewer parameters, no larger error)",
                 "full": "full diff (bias/norm)"}
    return "written as: " + ", ".join(f"{n} {described.get(form, form)}" for form, n in sorted(counts.items()))


def settings_for(rule: str, rank: int, value: float, dtype: str, tucker: bool) -> tuple[resize.Settings, str]:
    if dtype not in DTYPES:
        raise LycorisError(f"unknown dtype '{dtype}'; one of {', '.join(DTYPES)}")
    rank_rule = resize.rank_rule(rule, rank, value)
    text = f"rank {rank}" if rule == "fixed" else f"{rule} {value:g} (rank at most {rank})"
    return resize.Settings(rank_rule, DTYPES[dtype], tucker), text


class LycorisResize(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=TOOL,
            display_name="Resize LyCORIS",
            category=CATEGORY,
            description="Writes a LyCORIS/LoRA file of any algorithm as a plain LoRA/LoCon of a new rank, by SVD of "
                        "each module's change, with the measured relative error per module.",
            is_output_node=True,
            inputs=[
                lycoris_input(),
                output_name_input("lycoris/resized"),
                io.Combo.Input("rule", options=list(RULES), default="fixed", tooltip=RULE_TOOLTIP),
                io.Int.Input("rank", default=16, min=1, max=4096,
                             tooltip="'fixed': the rank of every module (a module whose change has a lower rank "
                                     "keeps that). Other rules: the largest rank they may pick."),
                io.Float.Input("value", default=0.9, min=0.0, max=1000.0, step=0.001,
                               tooltip="The dynamic rule's value (see 'rule'); unused by 'fixed'."),
                dtype_input("fp16"),
                io.Boolean.Input("tucker", default=True, optional=True,
                                 tooltip="Convs with a kernel (3×3…): write LoCon's Tucker form (lora_mid) where it "
                                         "has fewer parameters for no larger error than the plain LoCon."),
                io.Model.Input("model", optional=True,
                               tooltip="The model the file is for: needed by changes that read the base weight "
                                       "(DoRA, OFT, BOFT, (IA)³, GLoRA)."),
                io.Clip.Input("clip", optional=True, tooltip="The text encoder the file is for (as 'model')."),
                io.Combo.Input("on_missing_base", options=[ERROR, SKIP], default=ERROR, optional=True,
                               tooltip="A module that needs the base weight and has none: refuse (error), or leave "
                                       "it out of the file and list it in the report."),
                overwrite_input(),
            ],
            outputs=report_outputs(),
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, lycoris_name, output_name, rule, rank, value, dtype, tucker=True, model=None, clip=None,
                on_missing_base=ERROR, overwrite=False):
        settings, text = settings_for(rule, rank, value, dtype, tucker)
        report = run(lycoris_path(lycoris_name), model, clip, settings, on_missing_base, output_name, overwrite, text)
        return report.node_output()


NODES: list[type[io.ComfyNode]] = [LycorisResize]


# --- command line ---------------------------------------------------------------------------------------------------

CLI_HELP = "Resize a LoRA/LyCORIS file (any algorithm) to a plain LoRA/LoCon of a new rank, by SVD."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the LyCORIS/LoRA file: a name in the loras folder or a path")
    parser.add_argument("--rank", type=int, required=True,
                        help="fixed rule: the rank; dynamic rules: the largest rank (kohya's --new_rank)")
    parser.add_argument("--rule", choices=list(RULES), default="fixed", help="; ".join(f"{k}: {v}" for k, v in
                                                                                        RULES.items()))
    parser.add_argument("--value", type=float, default=0.9, help="the dynamic rule's value")
    parser.add_argument("--checkpoint", help="the model the file is for (checkpoints-folder name or path): needed "
                                             "by changes that read the base weight (DoRA, OFT, BOFT, (IA)3, GLoRA)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp16")
    parser.add_argument("--no-tucker", dest="tucker", action="store_false",
                        help="never write LoCon's Tucker form (lora_mid) for convs with a kernel")
    parser.add_argument("--skip-missing-base", action="store_true",
                        help="leave out (and list) modules that need the base weight when no --checkpoint is given")
    parser.add_argument("-o", "--output", required=True, help="output name in the loras folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")


def run_cli(args: argparse.Namespace) -> ToolReport:
    settings, text = settings_for(args.rule, args.rank, args.value, args.dtype, args.tucker)
    model = clip = None
    if args.checkpoint:
        model, clip = checkpoint(args.checkpoint)
    return run(input_path("loras", args.file), model, clip, settings, SKIP if args.skip_missing_base else ERROR,
               args.output, args.overwrite, text)
