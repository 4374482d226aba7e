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
    path = text_encoder_path(model_key)
    numbered = next((i for i, part in enumerate(path) if part.isdigit()), None)
    return ".".join(path[: numbered + 1] if numbered is not None else path[:2])


def text_encoder_path(model_key: str) -> tuple[str, ...]:
    """A text-encoder key as `te.<encoder>.<container>.<index>.<rest>`: the wrapper parts between the encoder and its
    first numbered container (`transformer.text_model.encoder`) are dropped, so block names stay short and a rule
    written with a block name matches the keys inside it."""
    encoder, *rest = model_key.split(".")
    numbered = next((i for i, part in enumerate(rest) if part.isdigit()), None)
    if numbered:
        rest = rest[numbered - 1:]
    return (TEXT_ENCODER, encoder, *rest)


def _numbered_prefix(parts: list[str]) -> str:
    for i, part in enumerate(parts):
        if part.isdigit() and i:
            return ".".join(parts[: i + 1])
    return parts[0]
