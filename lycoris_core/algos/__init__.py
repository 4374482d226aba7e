"""The algorithm registry, in the reference's detection order (lycoris.modules.get_module): first match wins.

A module's weight is patched by the first algorithm in WEIGHT_ALGORITHMS whose marker key it has; its bias by every
algorithm in BIAS_ALGORITHMS whose marker it has.
"""

from . import boft, full, glora, ia3, kohya_oft, locon, loha, lokr, oft
from .base import Algorithm, Layout, ShapeError, Tensors

WEIGHT_ALGORITHMS: tuple[Algorithm, ...] = (
    locon.ALGORITHM,
    loha.ALGORITHM,
    ia3.ALGORITHM,
    lokr.ALGORITHM,
    full.FULL,
    full.NORM,
    kohya_oft.ALGORITHM,  # its own marker (keys.py), before LyCORIS' diag-OFT all the same
    oft.ALGORITHM,
    boft.ALGORITHM,
    glora.ALGORITHM,
    oft.OLD_ALGORITHM,
)
BIAS_ALGORITHMS: tuple[Algorithm, ...] = (full.FULL_BIAS, full.NORM_BIAS)
BY_NAME: dict[str, Algorithm] = {a.name: a for a in WEIGHT_ALGORITHMS + BIAS_ALGORITHMS}
# Keys an algorithm reads into its layout and never again: the patch does not need them.
LAYOUT_ONLY_KEYS: frozenset[str] = frozenset({lokr.ROW_OFFSET})

__all__ = ["BIAS_ALGORITHMS", "BY_NAME", "LAYOUT_ONLY_KEYS", "WEIGHT_ALGORITHMS", "Algorithm", "Layout", "ShapeError",
           "Tensors"]
