"""What a file is, read from its header alone: algorithms, ranks, alphas, DoRA, dtypes, training metadata, trigger
words and the base model family (declared in metadata, or inferred from key names and shapes).

Tensor data is not read except the tiny `alpha`, `on_input` and `row_offset` scalars: modules are parsed on `meta`
tensors of the right shapes, with the same detection and layout code that patching uses.
"""

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from .algos import LAYOUT_ONLY_KEYS
from .algos.base import ShapeError
from .errors import MAX_NAME, LycorisError, clipped
from .keys import ALPHA, DORA_SCALE, OMI_PREFIXES
from .lycoris_file import group_keys, metadata_json, option_warnings, scale_warnings, software_name
from .module import Module, build_modules
from .module_config import MAX_BYTES, config_note, is_config_key, split_configs
from .peft_config import PATTERN_KEYS, PeftConfig, module_name, module_options, read_config
from .safetensors_file import SafetensorsFile

# Read for real: the layout needs their values (alpha, LoHa/IA3 on_input, row offsets, PEFT options held in the file).
SCALAR_SUFFIXES = (ALPHA, "on_input", *sorted(LAYOUT_ONLY_KEYS))
TRAINING_KEYS = {
    "ss_base_model_version": "base model", "ss_network_module": "network module", "ss_network_dim": "dim",
    "ss_network_alpha": "alpha", "ss_network_args": "network args", "ss_resolution": "resolution",
    "ss_num_train_images": "train images", "ss_epoch": "epochs", "ss_steps": "steps",
    "ss_learning_rate": "learning rate", "ss_optimizer": "optimizer", "ss_mixed_precision": "precision",
    "ss_output_name": "output name", "ss_training_comment": "comment", "ss_sd_model_name": "trained on",
    "modelspec.architecture": "architecture", "modelspec.title": "title", "modelspec.author": "author",
    "modelspec.description": "description", "modelspec.date": "date", "modelspec.resolution": "resolution",
}

# Base-model families from key names, first match wins: (family, regex over module prefixes).
FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    # HunyuanVideo shares Flux's block names. Its dotted keys differ (`img_attn_qkv`, `img_mlp.fc1` where Flux has
    # `img_attn.qkv`, `img_mlp.0`); in kohya's underscored form the two are the same and Flux is the likelier guess.
    ("HunyuanVideo", r"txt_in[._]individual_token_refiner|double_blocks\.\d+\.(img_attn_qkv|img_mlp\.fc1)"),
    ("Flux", r"double_blocks[._]\d+[._](img|txt)_(attn|mlp|mod)|single_blocks[._]\d+[._]linear"),
    ("SD3", r"joint_blocks[._]\d+"),
    ("Wan", r"blocks[._]\d+[._](cross_attn|self_attn)[._]"),
    # diffusers' Wan names (WanTransformer3DModel): a top-level `blocks` list with attn1/attn2/ffn.net; other DiTs
    # call theirs transformer_blocks, so the name must start there (after a trainer's prefix)
    ("Wan", (r"(?m)^(transformer\.|base_model\.model\.|lycoris_|lora_transformer_)?blocks[._]\d+[._]"
             r"(attn[12][._](to_|add_)|ffn[._]net[._])")),
    # Ideogram 4 (a NextDiT like Lumina 2, ComfyUI comfy/ldm/ideogram4/model.py): its own top-level projections,
    # a lower-case per-block `adaln_modulation` (Lumina's is `adaLN_modulation`), and `attention.o` for Lumina's `.out`
    ("Ideogram 4", (r"(?m)^(transformer\.|diffusion_model\.|base_model\.model\.|lora_unet_|lora_transformer_|"
                    r"lycoris_)?(adaln_proj|llm_cond_proj)$|layers[._]\d+[._](adaln_modulation|attention[._]o)$")),
    ("Z-Image / Lumina 2", r"(?m)^(\w+[._])?layers[._]\d+[._](attention[._](to_[qkv]|qkv)|feed_forward[._]w[123])"),
    ("Qwen-Image", r"transformer_blocks[._]\d+[._](img_mlp|txt_mlp|img_mod)"),
    ("SDXL", r"lora_te2_|text_encoder_2|input_blocks[._][78][._]1[._]transformer_blocks[._][1-9]"),
)
# SD1/SD2/SDXL share a UNet layout; the cross-attention context width tells them apart.
CONTEXT_DIM_FAMILY = {768: "SD1.x", 1024: "SD2.x", 2048: "SDXL"}


@dataclass
class ModuleSummary:
    key: str
    algorithm: str
    rank: int | None
    alpha: float | None  # the alpha the loader uses: the file's, else its PEFT config's; None when none gives one
    params: int
    conv: bool
    dora_axis: str | None = None
    tucker: bool = False
    scale: float | None = None  # what the loader multiplies the change by: alpha / rank (rsLoRA: alpha / sqrt(rank))


@dataclass
class FileSummary:
    name: str
    size_bytes: int
    module_count: int
    algorithms: dict[str, int]
    rank: dict[str, int] | None
    alpha: dict[str, float] | None
    conv_rank: dict[str, int] | None
    dtypes: dict[str, int]
    dora_axis: str | None
    tucker: bool
    params: int
    base_model: dict[str, str | None]
    trigger_words: list[str]
    title: str | None
    training: dict[str, str]
    lycoris_config: dict | None
    metadata_count: int
    unused_keys: int
    made_by: dict[str, str | None] = field(default_factory=dict)  # trainer, format, evidence, line (see made_by)
    alpha_from: dict = field(default_factory=dict)  # source, rslora, patterns, line (see _alpha_from)
    warnings: list[str] = field(default_factory=list)  # what the loader assumes where the file says nothing
    notes: list[str] = field(default_factory=list)  # what the file holds beside its modules (module configs)
    modules: list[ModuleSummary] = field(default_factory=list, repr=False)

    def to_json(self, with_modules: bool = False) -> dict:
        data = asdict(self)
        if not with_modules:
            data.pop("modules")
        return data

    def text(self) -> str:
        """A few human lines for the Info node's STRING output."""
        rank = f"rank {_span(self.rank)}" if self.rank else "no rank"
        alpha = f", alpha {_span(self.alpha)}" if self.alpha else ""
        algos = ", ".join(f"{name} ×{n}" for name, n in self.algorithms.items())
        lines = [
            f"{self.title or self.name}: {self.module_count} modules ({algos}), {rank}{alpha}",
            (f"base model: {self.base_model['declared'] or '?'} (declared), "
             f"{self.base_model['inferred'] or '?'} (from key names)"),
            (f"tensors: {', '.join(f'{d} ×{n}' for d, n in self.dtypes.items())}; {self.params:,} parameters; "
             f"{self.size_bytes / 2**20:.1f} MiB"),
        ]
        if self.alpha_from.get("line"):
            lines.append(self.alpha_from["line"])
        if self.made_by:
            lines.append(self.made_by["line"])
        if self.conv_rank:
            lines.append(f"conv layers: rank {_span(self.conv_rank)}")
        if self.dora_axis:
            lines.append(f"DoRA: magnitude per {'output row' if self.dora_axis == 'out' else 'input channel'}")
        if self.trigger_words:
            lines.append("trigger words: " + ", ".join(self.trigger_words))
        lines += [f"{label}: {value}" for label, value in self.training.items()]
        lines += [f"warning: {warning}" for warning in self.warnings]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _span(values: dict) -> str:
    return f"{values['min']:g}" if values["min"] == values["max"] else f"{values['min']:g}–{values['max']:g}"


def _range(values: list) -> dict | None:
    return {"min": min(values), "max": max(values)} if values else None


def _shape_only(reader: SafetensorsFile) -> dict[str, torch.Tensor]:
    """Meta tensors of the right shapes, except the scalars whose values the layouts need and the module configs
    (small JSON texts the summary reports)."""
    tensors = {}
    for key, entry in reader.entries.items():
        if (key.endswith(SCALAR_SUFFIXES) and entry.numel <= 1) or (is_config_key(key) and entry.numel <= MAX_BYTES):
            tensors[key] = reader.tensor(key)
        else:
            tensors[key] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    return tensors


def _module_summary(key: str, module: Module, alpha: float | None) -> ModuleSummary:
    tensors = module.tensors
    return ModuleSummary(
        key=key, algorithm=module.label, rank=module.layout.rank, alpha=alpha, scale=module.layout.scale,
        params=sum(t.numel() for t in tensors.values()),
        conv=any(t.ndim > 2 for name, t in tensors.items() if name != DORA_SCALE),
        dora_axis="out" if module.dora_per_output else _dora_axis(tensors.get(DORA_SCALE)),  # PEFT: per output
        tucker=any(name in tensors for name in ("lora_mid.weight", "hada_t1", "lokr_t2")),
    )


def _dora_axis(scale: torch.Tensor | None) -> str | None:
    if scale is None:
        return None
    return "in" if scale.ndim >= 2 and scale.shape[0] == 1 and scale.shape[1] > 1 else "out"


def trigger_words(metadata: dict[str, str], top: int = 8) -> list[str]:
    """modelspec.trigger_phrase first, then the most frequent training tags (kohya ss_tag_frequency)."""
    words = [w.strip() for w in metadata.get("modelspec.trigger_phrase", "").split(",") if w.strip()]
    frequency = metadata_json(metadata, "ss_tag_frequency")
    counts: Counter = Counter()
    for tags in frequency.values() if isinstance(frequency, dict) else ():
        if isinstance(tags, dict):
            counts.update({str(tag).strip(): n for tag, n in tags.items() if _is_count(n)})
    for tag, _n in counts.most_common():
        if len(words) >= top:
            break
        if tag and tag not in words:
            words.append(tag)
    return words


def _is_count(value) -> bool:
    """A tag count as kohya writes it: a non-negative JSON integer."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Families whose blocks share their module names, told apart by a block layer's input width (the hidden size):
# (regex over a module prefix, {input width: family}), checked before the name patterns. Ideogram 4's attention and
# feed-forward are named as Z-Image's (split to_q/to_k/to_v in diffusers' names, fused qkv in ComfyUI's) at 4608
# (18 heads x 256; Z-Image 3840, Lumina 2 2304).
FAMILY_WIDTHS: tuple[tuple[str, dict[int, str]], ...] = (
    (r"layers[._]\d+[._](attention[._](to_[qkv]|qkv)|feed_forward[._]w[13])$", {4608: "Ideogram 4"}),
)


# The language-model text encoders ComfyUI runs, told by their widths (comfy/text_encoders/llama.py configs:
# hidden_size, intermediate_size = the input widths of a layer's q_proj and down_proj), with every family whose
# text encoders include it (comfy/sd.py, comfy/text_encoders/*.py) and its place there (diffusers' text_encoder_N,
# kohya's lora_teN_). Widths several families share name the encoder and all of them (SHARED_ENCODER), unless the
# place tells one (HiDream's Llama is 4th). The shared ones as ComfyUI 0.33's supported_models clip_target builds
# them (a model class in brackets where its name differs from ours):
LANGUAGE_MODEL_ENCODERS: tuple[tuple[tuple[int, int], str, tuple[tuple[str, int], ...]], ...] = (
    ((4096, 14336), "Llama 3 8B", (("HunyuanVideo", 1), ("HiDream", 4))),  # hunyuan_video.py, hidream.py
    ((3840, 15360), "Gemma 3 12B", (("LTX-2", 1),)),  # lt.py
    ((5120, 32768), "Mistral Small 3.1 24B", (("Flux.2", 1),)),  # flux.py flux2_te
    ((3072, 9216), "Ministral 3 3B", (("ERNIE-Image", 1),)),  # ernie.py
    # Qwen25_7BVLI: qwen_image.te (QwenImage, its Edit models too), hunyuan_image.te (HunyuanImage21,
    # HunyuanVideo15), kandinsky5.te (Kandinsky5, Kandinsky5Image), longcat_image.te (LongCatImage)
    ((3584, 18944), "Qwen2.5-VL 7B", (("Qwen-Image", 1), ("HunyuanImage 2.1", 1), ("HunyuanVideo 1.5", 1),
                                      ("Kandinsky 5", 1), ("LongCat-Image", 1))),
    # Qwen3_4B (z_image.te: ZImage; flux.klein_te: Flux2 klein 4B; ace15.te lm_model="qwen3_4b": ACEStep15) and
    # Qwen3VL_4B (krea2.te: Krea2; mage_flow.te: MageFlow), one language model's widths
    ((2560, 9728), "Qwen3 4B (or Qwen3-VL 4B)", (("Z-Image", 1), ("Flux.2 klein 4B", 1), ("Krea 2", 1),
                                                  ("MageFlow", 1), ("ACE-Step 1.5", 1))),
    # Qwen3_8B (flux.klein_te: Flux2 klein 9B) and Qwen3VL_8B (ideogram4.te: Ideogram4; joyimage.te: JoyImage;
    # boogu.te: Boogu)
    ((4096, 12288), "Qwen3 8B (or Qwen3-VL 8B)", (("Flux.2 klein 9B", 1), ("Ideogram 4", 1), ("JoyImage", 1),
                                                  ("Boogu", 1))),
    ((1024, 3072), "Qwen3 0.6B", (("Anima", 1), ("ACE-Step 1.5", 1))),  # anima.te, ace15.te (its qwen3_06b)
    ((2304, 9216), "Gemma 2 2B", (("Lumina 2", 1), ("PixelDiT T2I", 1))),  # lumina2.te, pixeldit.PixelDiTGemma2TE
)
SHARED_ENCODER = "a {encoder} text encoder ({families})"  # what a file is said to be made for
# a decoder layer (CLIP's and the vision towers' are `encoder.layers.N`, their MLPs fc1/fc2)
LANGUAGE_MODEL_LAYER = re.compile(r"(?:^|(?<!encoder)[._])layers[._]\d+[._](?:self_attn[._](?P<attn>[qkv])_proj|"
                                  r"mlp[._](?P<mlp>gate|up|down)_proj)$")
TEXT_ENCODER_NAME = re.compile(r"^(?:lora_te|lora_prior_te|text_encoder)")  # kohya's, diffusers', ComfyUI's
ENCODER_PLACE = re.compile(r"^(?:lora_te(?P<kohya>\d*)_|text_encoder(?:_(?P<pipe>\d+))?\.)")  # no digit: the 1st


def infer_family(in_features: dict[str, int | None]) -> str | None:
    """The base model family the module names (and, for UNets, the cross-attention width) point to, or None. A
    language-model text encoder's layers are told by their widths; the other text-encoder modules beside it (its
    pipeline's CLIP) say nothing then, and a diffusion model's own modules still come first."""
    encoder = {p: w for p, w in in_features.items() if LANGUAGE_MODEL_LAYER.search(p)}
    if not encoder:
        return _family_of_names(in_features)
    rest = {p: w for p, w in in_features.items() if p not in encoder and not TEXT_ENCODER_NAME.match(p)}
    return _family_of_names(rest) or language_model_family(encoder)


def language_model_family(layers: dict[str, int | None]) -> str | None:
    """The family whose language-model text encoder these layers are (by hidden and MLP width, and the encoder's
    place where its name gives one); for widths several families share, the encoder and all of them
    (SHARED_ENCODER); None when the widths are unknown or disagree."""
    hidden, inner, places = set(), set(), set()
    for prefix, width in layers.items():
        found = LANGUAGE_MODEL_LAYER.search(prefix)
        (inner if found["mlp"] == "down" else hidden).add(width)
        if (place := ENCODER_PLACE.match(prefix)) is not None:
            places.add(int(place["kohya"] or place["pipe"] or 1))
    if len(hidden) != 1 or len(inner) > 1 or len(places) > 1:
        return None
    found = [(encoder, [family for family, place in users if not places or place in places])
             for widths, encoder, users in LANGUAGE_MODEL_ENCODERS
             if widths[0] in hidden and (not inner or widths[1] in inner)]
    found = [(encoder, families) for encoder, families in found if families]
    if len(found) != 1:
        return None
    encoder, families = found[0]
    return families[0] if len(families) == 1 else SHARED_ENCODER.format(encoder=encoder, families=", ".join(families))


def family_ids(name: str | None) -> set[str]:
    """The canonical ids (family_id) a family name stands for: each family of a shared text encoder (one without an
    id by its name run together: 'Kandinsky 5' -> 'kandinsky5', as ComfyUI's model class Kandinsky5), else the
    name's own id, if any."""
    for _widths, encoder, _users in LANGUAGE_MODEL_ENCODERS:
        start, end = SHARED_ENCODER.format(encoder=encoder, families="\0").split("\0")
        if name and name.startswith(start) and name.endswith(end):
            return {family_id(family) or compact_name(family) for family in name[len(start):-len(end)].split(", ")}
    return {family_id(name)} - {None}


def compact_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _family_of_names(in_features: dict[str, int | None]) -> str | None:
    """The family a diffusion model's module names (and, for UNets, the cross-attention width) point to, or None."""
    for pattern, widths in FAMILY_WIDTHS:
        for prefix, width in in_features.items():
            if width in widths and re.search(pattern, prefix):
                return widths[width]
    joined = "\n".join(in_features)
    for family, pattern in FAMILY_PATTERNS:
        if re.search(pattern, joined):
            return family
    for prefix, width in in_features.items():  # UNet cross-attention: attn2's to_k reads the text context
        if re.search(r"attn2[._]to_k$", prefix) and width in CONTEXT_DIM_FAMILY:
            return CONTEXT_DIM_FAMILY[width]
    if re.search(r"(input_blocks|down_blocks|middle_block|mid_block)", joined):
        return "SD (UNet)"
    return None


# Canonical family ids, so metadata values, our inferred names and ComfyUI's model classes can be compared.
FAMILY_IDS: tuple[tuple[str, str], ...] = (
    ("sdxl", r"sdxl|stable-diffusion-xl"),
    ("sd3", r"sd3|stable-diffusion-3"),
    ("sd2", r"sd_?v2|stable-diffusion-v2|^sd2"),
    ("sd1", r"sd_?v1|stable-diffusion-v1|^sd1"),
    ("flux", r"flux|chroma"),
    ("wan", r"^wan"),
    ("qwen-image", r"qwen"),
    ("hunyuan-video", r"hunyuan"),
    ("lumina", r"lumina|z-?image"),  # ComfyUI runs Z-Image as a Lumina 2 model (its ZImage class)
    ("ideogram", r"ideogram"),
    ("hidream", r"hidream"),
    ("ltx", r"^ltx"),
)


def family_id(name: str | None) -> str | None:
    """'sd_v1', 'stable-diffusion-v1/lora', 'SD1.x' and ComfyUI's 'SD15' all give 'sd1'; unknown names give None."""
    if not name:
        return None
    lowered = name.lower()
    return next((fid for fid, pattern in FAMILY_IDS if re.search(pattern, lowered)), None)


def declared_family(metadata: dict[str, str]) -> str | None:
    return metadata.get("ss_base_model_version") or metadata.get("modelspec.architecture") or None


# --- which trainer wrote the file, and in which name style ---------------------------------------------------------
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


def _alpha_used(module: Module, options: dict, in_file: bool) -> float | None:
    """The file's alpha, else the one the PEFT config gives this module (for rsLoRA its lora_alpha as written, not
    the alpha·√rank that Module.alpha holds so that alpha / rank is the scale)."""
    if in_file or module.alpha is None:
        return module.alpha
    return float(options.get("lora_alpha", options.get("alpha")))


def _alpha_from(config: PeftConfig | None, sources: Counter, metadata: dict[str, str]) -> dict:
    """Where the modules' alphas come from (`sources` counts "file", "config" and "assumed"), and the summary line
    for a PEFT config: the loader's scale rests on it, so the inspector says which one and what it holds."""
    if not sources["config"]:
        if sources["assumed"] and software_name(metadata) == "ai-toolkit":  # see lycoris_file.scale_warnings
            return {"source": "ai-toolkit", "rslora": False, "patterns": [],
                    "line": f"alpha = rank for {sources['assumed']} modules: ai-toolkit trains its PEFT format so"}
        return {"source": "file" if sources["file"] else None, "rslora": False, "patterns": [], "line": None}
    components = config.components.values()
    rslora = any(c.get("use_rslora") for c in components)
    patterns = [key for key in PATTERN_KEYS if any(c.get(key) for c in components)]
    line = (f"alpha from the PEFT config in {config.source} ({sources['config']} modules"
            + "".join(f", {key} of {max(len(c.get(key) or {}) for c in components)}" for key in patterns)
            + (", rsLoRA: scale = alpha/sqrt(rank)" if rslora else "") + ")")
    return {"source": config.source, "rslora": rslora, "patterns": patterns, "line": line}


def summarize(path) -> FileSummary:
    with SafetensorsFile(path) as reader:  # reads the header and the scalars the layouts need, nothing else
        return _summarize(path, reader)


def _summarize(path, reader: SafetensorsFile) -> FileSummary:
    config = read_config(path, reader.metadata)  # the loader's own source of a PEFT file's alpha
    state, configs, unreadable = split_configs(_shape_only(reader))
    groups, unknown = group_keys(state, reader.name)
    modules: list[ModuleSummary] = []
    in_features: dict[str, int | None] = {}
    alpha_sources: Counter = Counter()
    built_modules: list[Module] = []
    unused = len(unknown) + len(unreadable)
    damaged: list[tuple[str, str]] = []
    for prefix, group in groups.items():
        options = module_options(config, prefix)
        try:
            built, leftover = build_modules(prefix, group, reader.name, options, module_name(config, prefix))
        except LycorisError as e:
            unused += len(group)  # a damaged module: loading refuses the file, the summary says which
            damaged.append((e.key or prefix, e.reason))
            continue
        except ShapeError as e:
            unused += len(group)
            damaged.append((f"{prefix}.{e.key}" if e.key else prefix, e.reason))
            continue
        if any(m.alpha is not None and not math.isfinite(m.alpha) for m in built):
            unused += len(group)
            damaged.append((f"{prefix}.alpha", "alpha is NaN or Inf"))
            continue
        unused += len(leftover)
        modules += [_module_summary(f"{prefix}.{m.param}", m, _alpha_used(m, options, ALPHA in group)) for m in built]
        in_features[prefix] = built[0].layout.flat_in if built else None
        built_modules += built
        alpha_sources.update("file" if ALPHA in group else "assumed" if m.scale_assumed else "config"
                             for m in built if m.alpha is not None or m.scale_assumed)
    meta = reader.metadata
    lycoris_config = metadata_json(meta, "lycoris_config")
    ranks = [m.rank for m in modules if m.rank is not None]
    dora_axes = {m.dora_axis for m in modules if m.dora_axis}
    return FileSummary(
        name=reader.name, size_bytes=reader.size, module_count=len(modules),
        algorithms=dict(Counter(m.algorithm for m in modules).most_common()),
        rank=_range(ranks), alpha=_range([m.alpha for m in modules if m.alpha is not None]),
        conv_rank=_range([m.rank for m in modules if m.conv and m.rank is not None]),
        dtypes=dict(Counter(_dtype_name(e.dtype) for e in reader.entries.values()).most_common()),
        dora_axis=dora_axes.pop() if len(dora_axes) == 1 else ("mixed" if dora_axes else None),
        tucker=any(m.tucker for m in modules), params=sum(m.params for m in modules),
        base_model={"declared": declared_family(meta),
                    "inferred": infer_family(in_features)},
        trigger_words=trigger_words(meta),
        title=meta.get("modelspec.title") or meta.get("ss_output_name") or None,
        training={label: meta[key] for key, label in TRAINING_KEYS.items() if meta.get(key)},
        lycoris_config=lycoris_config, metadata_count=len(meta), unused_keys=unused,
        made_by=made_by(list(reader.entries), meta), alpha_from=_alpha_from(config, alpha_sources, meta),
        warnings=_damage_warnings(damaged) + scale_warnings(reader.name, built_modules, meta)
        + option_warnings(reader.name, ((m, m.layout) for m in built_modules)),
        notes=[config_note(reader.name, configs)] if configs else [], modules=modules,
    )


def _damage_warnings(damaged: list[tuple[str, str]]) -> list[str]:
    """One line for the modules loading refuses, so a damaged file never reads as a file of fewer modules."""
    if not damaged:
        return []
    (key, reason), more = damaged[0], len(damaged) - 1
    return [f"{len(damaged)} damaged {'module' if len(damaged) == 1 else 'modules'}: the loader refuses this file "
            f"('{clipped(key, MAX_NAME)}': {clipped(reason, 300)}" + (f"; and {more} more)" if more else ")")]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
            torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}.get(dtype, str(dtype).replace("torch.", ""))
