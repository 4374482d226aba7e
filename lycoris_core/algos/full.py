"""Full and Norm: the file holds the difference itself.

    Full:  W' = W + m·diff,    b' = b + m·diff_b
    Norm:  γ' = γ + m·w_norm,  β' = β + m·b_norm          (LayerNorm/GroupNorm with train_norm)

The difference is added as stored (`dense`): cast piece by piece by casting.add_scaled, never as a whole fp32 copy.
The bias parts patch the layer's `bias` and are separate modules for patching purposes.

Bypass: no form. ΔW is the stored diff itself, as large as W, so F(x; m·diff) is already the cheapest exact form, and
it is what the dense path computes (diff cast at each forward, not staged: a staged copy would be a second model).
"""

import torch

from ..casting import add_scaled
from .base import Algorithm, Layout, Tensors, require


def _difference(key: str, param: str, label: str) -> Algorithm:
    def layout(t: Tensors, alpha: float | None) -> Layout:
        (diff,) = require(t, key)
        return Layout(None, 1.0, diff.shape[0] if diff.ndim else 1, shape=tuple(diff.shape))

    def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
        add_scaled(out, t[key], m)

    name = key.replace("_", "-")
    return Algorithm(name=name, label=label, markers=(key,), keys=(key,), layout=layout,
                     add_into=add_into, dense=(key,), param=param, uses_alpha=False)


FULL = _difference("diff", "weight", "Full")
FULL_BIAS = _difference("diff_b", "bias", "Full (bias)")
NORM = _difference("w_norm", "weight", "Norm")
NORM_BIAS = _difference("b_norm", "bias", "Norm (bias)")
