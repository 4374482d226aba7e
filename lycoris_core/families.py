"""Which base model family a file is for: declared in its metadata, or inferred from its module names and widths
(a UNet's cross-attention width, a language-model text encoder's hidden and MLP widths); and canonical family ids, so
metadata values, inferred names and ComfyUI's model classes can be compared."""

import re

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
