"""Who made a file: the trainer, from the metadata its saver writes (or, for ComfyUI's own trainer, which writes
none, from key names only it writes together), and the format, from its key names."""

import re

from .keys import ALPHA, OMI_PREFIXES
from .lycoris_file import software_name

# What each trainer's saver writes, as read in its source:
#   OneTrainer (Nerogar/OneTrainer modules/modelSaver/BaseModelSaver._create_safetensors_header): ot_branch,
#     ot_revision (+ ot_config), modelspec.*, and ss_base_model_version for SDXL only.
#   ai-toolkit (ostris/ai-toolkit toolkit/metadata.get_meta_for_safetensors): software = {"name": "ai-toolkit", …}.
#   SimpleTuner (bghira/SimpleTuner helpers/training/save_hooks._save_lycoris): LyCORIS files with lycoris_config
#     and nothing else; its PEFT LoRAs are diffusers' save_lora_weights files, indistinguishable from other ones;
#     its LyCORIS extract tool writes format = simpletuner-lycoris-extract.
#   musubi-tuner (kohya-ss/musubi-tuner utils/sai_model_spec.build_metadata): sd-scripts' ss_* keys plus
#     modelspec.implementation = the model's own repository (below).
#   kohya sd-scripts (train_network.py): ss_* keys; ss_network_module names the network (lycoris.kohya for LyCORIS).
#   diffusers save_lora_weights: lora_adapter_metadata (the PEFT config) when the caller passes it.
#   ComfyUI's own trainer and DiffSynth-Studio write no trainer metadata: see COMFY_TRAINER_* and KEY_STYLES.
#
# What musubi-tuner writes for each architecture it trains (kohya-ss/musubi-tuner at 30c658c4,
# src/musubi_tuner/utils/sai_model_spec.py build_metadata: modelspec.implementation = IMPL_*, modelspec.architecture
# = ARCH_* + "/lora", or the user's --metadata_arch + "/lora"; training/trainer_base.py writes ss_base_model_version
# = the trainer's architecture_full_name, dataset/architectures.py ARCHITECTURE_*_FULL, even with --no_metadata):
# (modelspec.implementation, modelspec.architecture without "/lora", ss_base_model_version).
MUSUBI_MODELSPECS: tuple[tuple[str, str, str], ...] = (
    ("https://github.com/Tencent/HunyuanVideo", "hunyuan-video", "hunyuan_video"),
    ("https://github.com/Tencent-Hunyuan/HunyuanVideo-1.5", "hunyuan-video-1.5", "hunyuan_video_1_5"),
    ("https://github.com/Wan-Video/Wan2.1", "wan2.1", "wan"),  # Wan 2.1 and 2.2 alike
    ("https://github.com/lllyasviel/FramePack", "framepack", "framepack"),
    ("https://github.com/black-forest-labs/flux", "Flux.1-dev", "flux_kontext"),  # Flux.1 Kontext
    ("https://github.com/black-forest-labs/flux2", "Flux.2-dev", "flux_2_dev"),
    ("https://github.com/black-forest-labs/flux2", "Flux.2-klein-4b", "flux_2_klein_4b"),  # klein and klein-base
    ("https://github.com/black-forest-labs/flux2", "Flux.2-klein-9b", "flux_2_klein_9b"),
    ("https://github.com/QwenLM/Qwen-Image", "Qwen-Image", "qwen_image"),
    ("https://github.com/QwenLM/Qwen-Image", "Qwen-Image-Edit", "qwen_image_edit"),
    ("https://github.com/QwenLM/Qwen-Image", "Qwen-Image-Edit-Plus", "qwen_image_edit"),  # --model_version edit-2509
    ("https://github.com/QwenLM/Qwen-Image", "Qwen-Image-Edit-2511", "qwen_image_edit"),
    ("https://github.com/QwenLM/Qwen-Image-Layered", "Qwen-Image-Layered", "qwen_image_layered"),
    ("https://github.com/Tongyi-MAI/Z-Image", "Z-Image", "z_image"),
    ("https://github.com/kandinskylab/kandinsky-5", "Kandinsky-5", "kandinsky5"),
    ("https://github.com/HiDream-ai/HiDream-O1-Image", "HiDream-O1-Image", "hidream_o1_image"),
    ("https://huggingface.co/Comfy-Org/Ideogram-4", "Ideogram-4", "ideogram4"),
    ("https://github.com/krea-ai/krea-2", "Krea-2", "krea2"),
)
# What sd-scripts writes as modelspec.implementation (kohya-ss/sd-scripts at 48d368fa, library/sai_model_spec.py
# IMPL_*). Its Flux LoRAs carry musubi's Flux.1 Kontext repository too (with architecture flux-1-dev/lora and
# ss_base_model_version flux1), so for these the architecture or the base model version must be musubi's as well.
SD_SCRIPTS_IMPLEMENTATIONS = ("https://github.com/Stability-AI/generative-models",
                              "https://github.com/comfyanonymous/ComfyUI", "diffusers",
                              "https://github.com/black-forest-labs/flux", "https://huggingface.co/lodestones/Chroma",
                              "https://github.com/Alpha-VLLM/Lumina-Image-2.0",
                              "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1",
                              "https://huggingface.co/circlestone-labs/Anima")

# ComfyUI's own trainer (comfy_extras/nodes_train.py of ComfyUI 0.3.75 and 0.33): TrainLoraNode puts an adapter on
# every module of BaseModel.named_modules() that ComfyUI can patch, named `<module>.<parameter>`, so every key is under
# `diffusion_model.`; a weight of two or more dimensions gets LoRA, LoHa, LoKr or OFT (comfy/weight_adapter/*.py:
# create_train, the parameters below, always with its alpha), a 1-D weight (a norm) a BiasDiff saved as `.diff`,
# every bias a BiasDiff saved as `.diff_b`; SaveLoRA writes them with no metadata. ComfyUI's Extract and Save Lora
# (comfy_extras/nodes_lora_extract.py) writes `.diff`/`.diff_b` beside lora_up/lora_down too, but never an alpha.
COMFY_TRAINER_ADAPTER_KEYS = ("lora_up.weight", "lora_down.weight", "lora_mid.weight",
                              "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
                              "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2",
                              "oft_blocks", "rescale")
COMFY_TRAINER_DIFF_KEYS = ("diff", "diff_b")
COMFY_TRAINER_EVIDENCE = ("no metadata; every key under diffusion_model., an alpha beside every adapter and "
                          ".diff/.diff_b on norms and biases, as ComfyUI's TrainLoraNode + SaveLoRA write them")

# Key-name styles, first match wins: (format, the trainer it is named for or None, regex over the file's
# keys). A style names a trainer only when that trainer was already told by its metadata: other tools write
# the same names.
_NOT_A_KNOWN_PREFIX = (r"(?!(base_model\.model|diffusion_model|model\.diffusion_model|transformer|unet|"
                       r"text_encoder(_\d)?)\.)")
KEY_STYLES: tuple[tuple[str, str | None, str], ...] = (
    ("PEFT save_pretrained names (base_model.model.…)", None, r"^base_model\.model\."),
    ("kohya sd-scripts OFT names (oft_unet_…)", None, r"^oft_unet_"),
    # before the diffusers entries: OMI's unet./transformer. prefixes are diffusers' too, its module paths are not
    ("OneTrainer OMI names (unet./transformer./clip_l./t5. + the original model's paths)", None,
     "^(" + "|".join(re.escape(prefix) for prefix in OMI_PREFIXES) + ")"),
    # OneTrainer's output formats (Nerogar/OneTrainer at 23df3832, modules/modelSaver/mixin/LoRASaverMixin.py,
    # modules/util/enum/ModelFormat.py): COMFY_LORA swaps the denoiser's prefix for diffusion_model. (original paths,
    # lora_A/lora_B, alpha kept); LEGACY_LORA is convert_to_mixture for HunyuanVideo and Flux (lora_transformer_ +
    # the diffusers path underscored) and the canonical dict for Z-Image, Qwen-Image and Flux.2 (transformer. +
    # diffusers path, lora_down/lora_up + alpha)
    ("OneTrainer COMFY format (diffusion_model. + the original model's paths, alpha kept)", "OneTrainer",
     r"^diffusion_model\."),
    ("OneTrainer LEGACY format (lora_transformer_ + diffusers paths)", "OneTrainer", r"^lora_transformer_"),
    ("OneTrainer LEGACY format (transformer. + diffusers paths, lora_down/lora_up + alpha)", "OneTrainer",
     r"^(transformer|text_encoder(_\d)?)\..*\.lora_(down|up)\.weight$"),
    # DiffSynth-Studio (modelscope/DiffSynth-Studio at fed7b18f, diffsynth/diffusion/training_module.py
    # add_lora_to_model = PEFT's inject_adapter_in_model, export_trainable_state_dict minus --remove_prefix_in_ckpt;
    # logger.py ModelLogger.save_model = accelerate's save, metadata format = pt only): its own model's paths with
    # PEFT's adapter name. PEFT's own savers drop the adapter name, and diffusers' add a prefix.
    ("DiffSynth-Studio names (PEFT with its adapter name, no prefix)", None,
     rf"^{_NOT_A_KNOWN_PREFIX}\w+\..*\.lora_[AB]\.default\.weight$"),
    ("diffusers/PEFT names (lora_A/lora_B)", None, r"\.lora_[AB]\.(default\.)?weight$"),
    ("diffusers attention-processor names (lora.down/lora.up)", None, r"[._]lora\.(down|up)\.weight$"),
    ("LyCORIS wrapper names (lycoris_…)", None, r"^lycoris_"),
    ("kohya names (lora_unet_… / lora_te…)", None, r"^lora_(unet|te\d?|transformer)_"),
    ("original-model names (diffusion_model.…)", None, r"^(diffusion_model|model\.diffusion_model)\."),
    ("diffusers names (unet./transformer./text_encoder.…)", None, r"^(unet|transformer|text_encoder(_\d)?)\."),
)


def _musubi(metadata: dict[str, str]) -> str | None:
    """The evidence that musubi-tuner wrote the file (its modelspec for one of its architectures), or None."""
    implementation = metadata.get("modelspec.implementation")
    specs = [(arch, base) for impl, arch, base in MUSUBI_MODELSPECS if impl == implementation]
    if not specs:
        return None
    evidence = f"ss_ keys and modelspec.implementation = {implementation}"
    architecture = metadata.get("modelspec.architecture", "")
    if architecture.removesuffix("/lora") in {arch for arch, _base in specs}:
        return f"{evidence}, modelspec.architecture = {architecture}"
    if metadata.get("ss_base_model_version") in {base for _arch, base in specs}:  # a --metadata_arch of the user's
        return f"{evidence}, ss_base_model_version = {metadata['ss_base_model_version']}"
    return None if implementation in SD_SCRIPTS_IMPLEMENTATIONS else evidence


def _comfy_trainer(keys: list[str]) -> bool:
    """Whether the keys are all and only what ComfyUI's TrainLoraNode + SaveLoRA write (see COMFY_TRAINER_*)."""
    adapters, alphas, diffs = set(), set(), 0
    for key in keys:
        if not key.startswith("diffusion_model."):
            return False
        suffix = next((s for s in (*COMFY_TRAINER_ADAPTER_KEYS, *COMFY_TRAINER_DIFF_KEYS, ALPHA)
                       if key.endswith("." + s)), None)
        if suffix is None:
            return False
        module = key[:-len(suffix) - 1]
        if suffix == ALPHA:
            alphas.add(module)
        elif suffix in COMFY_TRAINER_DIFF_KEYS:
            diffs += 1
        else:
            adapters.add(module)
    return bool(adapters) and diffs > 0 and alphas == adapters


def _trainer(keys: list[str], metadata: dict[str, str]) -> tuple[str | None, str]:
    """(trainer, evidence) from the metadata trainers write, or from key names only one trainer writes without
    metadata; (None, why not) when none names itself."""
    ot_keys = [k for k in ("ot_revision", "ot_branch", "ot_config") if k in metadata]
    if ot_keys:
        return "OneTrainer", f"{ot_keys[0]} in metadata"
    if software_name(metadata) == "ai-toolkit":
        return "ai-toolkit", "software = ai-toolkit in metadata"
    if metadata.get("format") == "simpletuner-lycoris-extract":
        return "SimpleTuner", "format = simpletuner-lycoris-extract in metadata"
    module = metadata.get("ss_network_module")
    has_ss = any(k.startswith("ss_") for k in metadata)
    if has_ss and (musubi := _musubi(metadata)):
        return "musubi-tuner", musubi
    if has_ss:
        return "kohya sd-scripts", f"ss_network_module = {module}" if module else "ss_ keys in metadata"
    if "lycoris_config" in metadata:
        return "SimpleTuner", "lycoris_config and no other metadata, as SimpleTuner's LyCORIS saver writes"
    if "lora_adapter_metadata" in metadata:
        return None, "diffusers' lora_adapter_metadata names no trainer"
    if not metadata and _comfy_trainer(keys):
        return "ComfyUI trainer", COMFY_TRAINER_EVIDENCE
    return None, "no trainer metadata"


def _key_style(keys: list[str], metadata: dict[str, str], trainer: str | None) -> str:
    if metadata.get("ss_network_module") == "lycoris.kohya":
        return "LyCORIS through sd-scripts (kohya names)"
    for style, needs, pattern in KEY_STYLES:
        if needs in (None, trainer) and any(re.search(pattern, key) for key in keys):
            return style
    return "unrecognised names"


def made_by(keys: list[str], metadata: dict[str, str]) -> dict[str, str | None]:
    """The trainer and format a file shows: trainer from its metadata (or, for ComfyUI's trainer, which writes none,
    from key names only it writes), format from its key names (and from diffusers' lora_adapter_metadata). `line` is
    the one line the Info node and the panel show."""
    trainer, evidence = _trainer(keys, metadata)
    style = _key_style(keys, metadata, trainer)
    if "lora_adapter_metadata" in metadata:
        style += ", diffusers save_lora_weights with its PEFT config"
    line = f"made by: {trainer or 'unknown trainer'}; {style} ({evidence})"
    return {"trainer": trainer, "format": style, "evidence": evidence, "line": line}
