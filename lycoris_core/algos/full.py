"""Full and Norm: the file holds the difference itself.

    Full:  W' = W + m·diff,    b' = b + m·diff_b
    Norm:  γ' = γ + m·w_norm,  β' = β + m·b_norm          (LayerNorm/GroupNorm with train_norm)
    Modulation:  M' = M + m·diff_m                        (LightX2V: a Wan block's `modulation` parameter)

The difference is added as stored (`dense`): cast piece by piece by casting.add_scaled, never as a whole fp32 copy.
The bias and modulation parts patch the layer's `bias` / `modulation` and are separate modules for patching
purposes; a modulation is merged in every apply mode (it is no Linear/Conv weight: no forward to run it in).

Bypass: no form. ΔW is the stored diff itself, as large as W, so F(x; m·diff) is already the cheapest exact form, and
it is what the dense path computes (diff cast at each forward, not staged: a staged copy would be a second model).
"""

import torch

from ..casting import add_scaled
from .base import Algorithm, Layout, Tensors, narrowed_rows, require


def _difference(key: str, param: str, label: str, no_peft_form: str, split: bool = False,
                kohya_key: str | None = None) -> Algorithm:
    def layout(t: Tensors, alpha: float | None) -> Layout:
        (diff,) = require(t, key)
        return Layout(None, 1.0, diff.shape[0] if diff.ndim else 1, shape=tuple(diff.shape))

    def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
        add_scaled(out, t[key], m)

    def rows(t: Tensors, lay: Layout, start: int, count: int) -> tuple[Tensors, Layout]:
        return narrowed_rows(t, lay, start, count, key)

    name = key.replace("_", "-")
    return Algorithm(name=name, label=label, markers=(key,), keys=(key,), layout=layout,
                     add_into=add_into, dense=(key,), param=param, uses_alpha=False, rows=rows if split else None,
                     no_peft_form=no_peft_form, kohya_renames=((key, kohya_key),) if kohya_key else ())


# a weight's and a bias's difference split by output rows; a norm layer's is never part of a fused projection
FULL = _difference("diff", "weight", "Full", "a full weight difference has no PEFT adapter form (PEFT's "
                   "modules_to_save replaces a weight, it does not add to it)", split=True)
FULL_BIAS = _difference("diff_b", "bias", "Full (bias)", "a full bias difference has no PEFT adapter form", split=True)
NORM = _difference("w_norm", "weight", "Norm", "a norm-layer difference has no PEFT adapter form")
NORM_BIAS = _difference("b_norm", "bias", "Norm (bias)", "a norm-layer bias difference has no PEFT adapter form")
# LightX2V's distill LoRAs (ModelTC/LightX2V tools/extract/lora_extractor.py `_generate_lora_diff_key`: a Wan
# block's `modulation` parameter, shape (1, 6, dim), written as `<block>.diff_m`; lightx2v/utils/lora_loader.py
# `apply_lora` adds it as param += diff·strength, like `.diff`): the block's own parameter, no Linear or Conv forward
# Convert writes it for kohya as `diff` on the parameter's own name (`….modulation.diff`), how ComfyUI's generic key map
# names a parameter that is no `.weight`.
MODULATION = _difference("diff_m", "modulation", "Full (modulation)", "a full difference of a modulation parameter "
                         "(LightX2V's diff_m) has no PEFT adapter form", kohya_key="diff")
