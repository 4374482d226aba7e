"""ComfyUI's own OFT (comfy/weight_adapter/oft.py `OFTDiff`, the adapter comfy_extras/nodes_train.py trains):
LyCORIS' diag-OFT layout and key names, with the constraint taken as alpha itself.

    Q = B − Bᵀ per block;  if C > 0: Q ← Q · min(1, C / (‖Q‖_F + 1e-8))   (norm over all blocks, C = alpha)
    R = (I + Q)(I − Q)⁻¹                                                   (Cayley, fp32 or wider)
    W'_k = ρ_k ⊙ (R_kᵀ W_k),   W_k = W[k·b:(k+1)·b]                        (ρ = optional `rescale`)

The one difference from LyCORIS' diag-OFT (oft.py) is C: LyCORIS builds its module with C = alpha · out, ComfyUI
(OFTDiff, and its core loader's OFTAdapter.calculate_weight in 0.3.75 and 0.33) compares ‖Q‖ with alpha. A file
read the LyCORIS way is wrong on every layer where alpha < ‖Q‖_F + 1e-8, i.e. wherever ComfyUI clamps. ComfyUI's
clamp is `if ‖Q‖ + 1e-8 > C: Q·C / (‖Q‖ + 1e-8)`, the same expression as oft.cayley's; alpha ≤ 0 (or none) means
unconstrained, as its loader reads it (`if alpha > 0`).

Which files: ComfyUI's trainer (TrainLoraNode, saved by SaveLoRA as a bare safetensors file: no metadata) names each
module by its path in ComfyUI's model, `diffusion_model.<path>`, writing `.oft_blocks` (n, b, b), `.alpha` (0-d, 1.0
for every module it creates) and no `rescale`. LyCORIS never writes a dotted module name (lycoris-lora 4.1.3 replaces
every "." of `<prefix>.<path>` with "_", and its prefixes are `lycoris`, `lora_unet`, `lora_te…`), nor does this
pack's Save tool for a diffusion-model weight (kohya's `lora_unet_` name comes first). So 3-D `oft_blocks` under a
name read as `diffusion_model.…` is ComfyUI's (`prefixes` below).

Multiplier: as diag-OFT, linear or I + m(R − I), the latter being what OFTDiff.g and ComfyUI 0.33's bypass loader
do; its merge path's m² (W + m·(mR − mI)ᵀW) is not copied. Rescale, which ComfyUI's trainer never writes, is applied
as OFTDiff applies it (its loader ignores it). Merge and bypass forms are diag-OFT's (oft.merge_into, oft.bypass):
only the layout's constraint differs.
"""

from dataclasses import replace

from . import oft
from .base import Algorithm, Layout, Tensors

PREFIX = "diffusion_model."  # ComfyUI's name of the diffusion model, the root of every module its trainer saves


def layout(t: Tensors, alpha: float | None) -> Layout:
    """diag-OFT's layout checks, with C = alpha (0: unconstrained) instead of alpha · out."""
    return replace(oft.layout(t, alpha), constraint=alpha if alpha is not None and alpha > 0 else 0.0)


ALGORITHM = Algorithm(
    name="comfy-oft", label="OFT (ComfyUI trainer)", markers=(oft.BLOCKS,), marker_ndim=3,
    keys=(oft.BLOCKS, oft.RESCALE), prefixes=(PREFIX,),
    layout=layout, merge_into=oft.merge_into, bypass=oft.bypass, reads_param=True,
)
