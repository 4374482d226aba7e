"""The loader nodes: LyCORIS Loader and LyCORIS Loader (Model Only)."""


from comfy_api.latest import io

from ..glue.apply import apply_file, is_off, map_file
from ..glue.cache import load_cached
from ..glue.inputs import (
    CATEGORY,
    DEFAULT_APPLY_MODE,
    apply_mode_input,
    clip_input,
    fingerprint_by_file,
    lycoris_input,
    lycoris_path,
    mode_input,
    model_clip_outputs,
    model_input,
    node_key,
    strength_input,
)
from ..glue.lora_files import validate_name
from ..glue.report import panel_ui, payload


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
