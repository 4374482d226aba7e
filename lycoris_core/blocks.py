"""Block names from a model's own key structure: the path up to its first numeric component.

    diffusion_model.input_blocks.4.1.proj_in.weight      -> input_blocks.4
    diffusion_model.double_blocks.3.img_attn.qkv.weight  -> double_blocks.3
    diffusion_model.blocks.12.cross_attn.k.weight        -> blocks.12
    diffusion_model.final_layer.linear.weight            -> final_layer
    clip_l.transformer.text_model.encoder.layers.5.…     -> te.clip_l.layers.5

Works for any architecture ComfyUI loads, including ones we have never seen: they fall back to their top-level
numbered containers.
"""

MODEL_PREFIX = "diffusion_model."
TEXT_ENCODER = "te"


def block_of(model_key: str) -> str:
    if model_key.startswith(MODEL_PREFIX):
        return _numbered_prefix(model_key[len(MODEL_PREFIX):].split("."))
    parts = model_key.split(".")
    encoder, rest = parts[0], parts[1:]
    for i, part in enumerate(rest):
        if part.isdigit():
            return f"{TEXT_ENCODER}.{encoder}.{rest[i - 1]}.{part}" if i else f"{TEXT_ENCODER}.{encoder}.{part}"
    return f"{TEXT_ENCODER}.{encoder}"


def _numbered_prefix(parts: list[str]) -> str:
    for i, part in enumerate(parts):
        if part.isdigit() and i:
            return ".".join(parts[: i + 1])
    return parts[0]
