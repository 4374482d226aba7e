"""The loader nodes: LyCORIS Loader and LyCORIS Loader (Model Only)."""

import weakref
from collections import OrderedDict

import folder_paths
import torch
from comfy_api.latest import io

from . import lora_files
from .apply import apply_file, is_off, map_file
from .bypass import MODES
from .cache import file_identity, load_cached
from .lora_files import validate_name
from .report import LOADER_MEASURE_BUDGET, block_changes, is_dynamic, patchers_of, payload, touched_elements

CATEGORY = "loaders/lycoris"
STRENGTH_MODES = ["linear", "lycoris"]
STRENGTH_MODE_TOOLTIP = (
    "How strength acts on DoRA, OFT and BOFT files. 'linear': the change scales linearly with strength "
    "(0 = off, 1 = exactly the file, -1 = inverted). 'lycoris': LyCORIS' own multiplier semantics for those "
    "algorithms (identical at strength 1). Other algorithms behave the same in both modes."
)


def model_input() -> io.Model.Input:
    return io.Model.Input("model", tooltip="The diffusion model the file is applied to.")


def clip_input(optional: bool = False) -> io.Clip.Input:
    return io.Clip.Input("clip", optional=optional, tooltip="The text encoder the file is applied to.")


def model_clip_outputs() -> list:
    return [io.Model.Output(display_name="MODEL", tooltip="The patched diffusion model."),
            io.Clip.Output(display_name="CLIP", tooltip="The patched text encoder.")]


def lycoris_input() -> io.Combo.Input:
    return io.Combo.Input("lycoris_name", options=folder_paths.get_filename_list("loras"),
                          tooltip="The LyCORIS/LoRA file (.safetensors) from the loras folder.")


def strength_input(name: str, what: str) -> io.Float.Input:
    return io.Float.Input(name, default=1.0, min=-100.0, max=100.0, step=0.01,
                          tooltip=f"How strongly to change the {what}. 0 leaves it unchanged; negative inverts.")


def mode_input() -> io.Combo.Input:
    return io.Combo.Input("strength_mode", options=STRENGTH_MODES, default="linear", optional=True,
                          tooltip=STRENGTH_MODE_TOOLTIP)


# `auto` is exact on quantized layers and merges plain float layers exactly as `merge` does: a user who loads a
# quantized model gets the file as trained without knowing about apply modes, and nothing changes on other models.
DEFAULT_APPLY_MODE = "auto"
APPLY_MODE_TOOLTIP = (
    "'auto' (default) bypasses the layers a merge would re-round: fp8 and quantized (ComfyUI's scaled fp8 and "
    "comfy_quant layers), so the change is added in full precision and the result is the file as trained "
    "(measured on an fp8 model: about 1.1x the time of a step for LoRA/LoCon, 2x for DoRA); it merges every other "
    "layer as 'merge' does (an fp32 layer is bypassed too where ComfyUI would merge it through an fp16 copy), "
    "GGUF included (the GGUF pack patches the decoded weight, so that is exact). "
    "'merge' patches the weights: no cost per step, but on an fp8 or quantized layer ComfyUI rounds W+dW back to "
    "the stored format, which loses part of the change (6-50% measured, by format). 'bypass' leaves every "
    "Linear/Conv weight untouched and adds the adapter in the layer's forward: a strength change re-patches "
    "nothing. Bypassed changes cost time at every step and are not in the weights: use 'merge' for a model you "
    "save. Biases and norm layers are merged, except an fp8 bias in 'bypass' and 'auto': its change is added in "
    "the forward too."
)


def apply_mode_input() -> io.Combo.Input:
    return io.Combo.Input("apply_mode", options=list(MODES), default=DEFAULT_APPLY_MODE, optional=True,
                          tooltip=APPLY_MODE_TOOLTIP)


def node_key(node: type[io.ComfyNode]) -> str | None:
    """The node instance's id in the prompt: a bypass injection key that is stable across re-runs of this node
    and different from every other node's. None outside a prompt (then each call gets a fresh key)."""
    hidden = getattr(node, "hidden", None)
    return getattr(hidden, "unique_id", None)


def lycoris_path(lycoris_name: str) -> str:
    found = lora_files.full_path(lycoris_name)
    if found is None:  # ComfyUI's own error for a missing file
        return folder_paths.get_full_path_or_raise(lora_files.FOLDER, lycoris_name)
    return found


def file_stamp(lycoris_name) -> str:
    """The file's identity (cache.file_identity) as text: it changes when the file, or the adapter_config.json beside
    it, is rewritten."""
    path = lora_files.full_path(lycoris_name) if isinstance(lycoris_name, str) else None
    return "missing" if path is None else repr(file_identity(path))


def fingerprint_by_file(cls, lycoris_name=None, **_inputs) -> str:
    """A node's `fingerprint_inputs`: ComfyUI re-runs a node whose fingerprint changed even when its inputs did
    not, so a file rewritten under the same name (a retrained LoRA) is read and checked again on the next run
    instead of the old result being served from ComfyUI's cache."""
    return file_stamp(lycoris_name)


# The panel's chart at strength 1, per model object (clones share it; the chart reads the weights as loaded, not a
# clone's patches), then per (file identity, side, block weights). In linear strength mode every change is linear in
# the strength, W'(m) − W = m·(W'(1) − W), so each block's ‖ΔW‖/‖W‖ at strength s is |s| times its value at 1: a
# strength change rescales the cached chart instead of another patch pass over every touched weight (0.25 s on one
# SDXL transformer block, six times the re-patching itself; bench/README.md). Numbers only: no tensor is kept.
# At most CHARTS_PER_MODEL charts per model, least recently used dropped first: a checkpoint stays loaded for the
# whole session, and every new block-weight text or rewritten file is a new key (issue #23: a sweep of block weights
# grew the table by one chart per run, for as long as ComfyUI ran).
CHARTS_PER_MODEL = 64
_charts: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()


def _chart(model: torch.nn.Module, key: tuple, measure) -> list[dict]:
    """The chart kept for (model, key), measured by `measure()` when missing."""
    charts = _charts.setdefault(model, OrderedDict())
    if key in charts:
        charts.move_to_end(key)
    else:
        charts[key] = measure()
        while len(charts) > CHARTS_PER_MODEL:
            charts.popitem(last=False)
    return charts[key]


def measured_blocks(path: str, report, patchers: dict, strengths: dict[str, float], weights=None) -> list[dict]:
    """block_changes at these strengths, measured once per model, file, side and block weights and rescaled."""
    if any(applied.plan.reference for applied in report.targets.values()):
        return block_changes(report, patchers, strengths, weights)  # LyCORIS semantics: DoRA, OFT not linear in m
    identity = file_identity(path)
    blocks = []
    for side, patcher in patchers.items():  # model, then clip: block_changes' model order (no block spans both)
        chart = _chart(patcher.model, (identity, side, weights),
                       lambda side=side, patcher=patcher: block_changes(report, {side: patcher}, {side: 1.0}, weights))
        blocks += [{**block, "change": abs(strengths[side]) * block["change"]} for block in chart]
    return blocks


def panel_ui(path: str, report, model, clip, strength_model: float, strength_clip: float, weights=None) -> dict:
    """The panel's payload: coverage, per-block change (when cheap enough on every run) and the file summary.
    Not measured (blocks None, the reason in `not_measured`) for a large file, or when dynamic VRAM loading keeps
    the weights offloaded: reading them would pull them through RAM on every run just for a chart."""
    patchers = patchers_of(model, clip)
    blocks, not_measured = None, None
    if touched_elements(report) > LOADER_MEASURE_BUDGET:
        not_measured = "large file"
    elif any(is_dynamic(patcher) for patcher in patchers.values()):
        not_measured = "weights offloaded by dynamic VRAM loading"
    else:
        blocks = measured_blocks(path, report, patchers, {"model": strength_model, "clip": strength_clip}, weights)
    data = payload(path, report, blocks)
    if not_measured:
        data["not_measured"] = not_measured
    return {"lycoris": [data]}


def panel_off(lycoris_name: str, model, clip) -> dict:
    """At strength 0 nothing is patched, but the panel should still say what would fit instead of an old report."""
    path = lycoris_path(lycoris_name)
    _patches, report = map_file(load_cached(path), model, clip, reference=False)
    data = payload(path, report, None)
    data["line"] = f"{report.file}: strength 0, nothing applied ({len(report.applied)}/{report.total} modules fit)"
    return {"lycoris": [data]}


def load_and_apply(model, clip, lycoris_name: str, strength_model: float, strength_clip: float, strength_mode: str,
                   weights=None, apply_mode: str = DEFAULT_APPLY_MODE, injection_key: str | None = None) -> tuple:
    """(model, clip, panel payload) for every loader-like node; a side whose strength is off comes back unchanged."""
    reference = strength_mode == "lycoris"
    if is_off(strength_model, reference) and is_off(strength_clip, reference):
        return model, clip, panel_off(lycoris_name, model, clip)
    path = lycoris_path(lycoris_name)
    new_model, new_clip, report = apply_file(load_cached(path), model, clip, strength_model, strength_clip,
                                             reference, weights, apply_mode, injection_key)
    return new_model, new_clip, panel_ui(path, report, model, clip, strength_model, strength_clip, weights)


class LycorisLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisLoader",
            display_name="LyCORIS Loader",
            category=CATEGORY,
            description=(
                "Applies a LyCORIS or LoRA-family file (LoCon, LoHa, LoKr, GLoRA, DoRA, OFT, BOFT, IA3, full/norm "
                "diffs) to the diffusion model and text encoder exactly as the LyCORIS reference defines it, on any "
                "weight dtype and offload mode. Modules that do not fit are listed in one warning; a file that fits "
                "nothing is an error."
            ),
            inputs=[
                model_input(),
                clip_input(),
                lycoris_input(),
                strength_input("strength_model", "diffusion model"),
                strength_input("strength_clip", "text encoder"),
                mode_input(),
                apply_mode_input(),
            ],
            outputs=model_clip_outputs(),
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, model, clip, lycoris_name, strength_model, strength_clip, strength_mode="linear",
                apply_mode=DEFAULT_APPLY_MODE):
        new_model, new_clip, ui = load_and_apply(model, clip, lycoris_name, strength_model, strength_clip,
                                                 strength_mode, apply_mode=apply_mode, injection_key=node_key(cls))
        return io.NodeOutput(new_model, new_clip, ui=ui)


class LycorisLoaderModelOnly(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisLoaderModelOnly",
            display_name="LyCORIS Loader (Model Only)",
            category=CATEGORY,
            description=(
                "Applies a LyCORIS or LoRA-family file to the diffusion model only, exactly as the LyCORIS reference "
                "defines it. Text-encoder modules in the file are reported, not applied."
            ),
            inputs=[
                model_input(),
                lycoris_input(),
                strength_input("strength_model", "diffusion model"),
                mode_input(),
                apply_mode_input(),
            ],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The patched diffusion model.")],
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, model, lycoris_name, strength_model, strength_mode="linear", apply_mode=DEFAULT_APPLY_MODE):
        new_model, _clip, ui = load_and_apply(model, None, lycoris_name, strength_model, 0.0, strength_mode,
                                              apply_mode=apply_mode, injection_key=node_key(cls))
        return io.NodeOutput(new_model, ui=ui)


NODES: list[type[io.ComfyNode]] = [LycorisLoader, LycorisLoaderModelOnly]
