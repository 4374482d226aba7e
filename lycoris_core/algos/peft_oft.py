"""PEFT's OFT (peft ≥ 0.17 `oft_R`): an orthogonal rotation of the weight's INPUT side, block by block.

    `oft_R.weight` (r, b(b−1)/2): per block k the strict upper triangle U_k of a b×b matrix, Q_k = U_k − U_kᵀ
    COFT (`coft`):   Q_k ← Q_k · min(1, ε' / ‖Q_k‖_F),   ε' = eps / √r                     (per block)
    Cayley–Neumann (`use_cayley_neumann`, default), n = `num_cayley_neumann_terms` (default 5):
        R_k = I + 2·Σ_{j=1..J} Q_kʲ + Q_k^(J+1),   J = max(2, n−2)      (n = 2: I + 2Q_k; n ≤ 1: I)
        PEFT 0.16/0.17 (a config without `peft_version`, which PEFT stores since 0.18, when it changed the series):
        R_k = I + 2·Σ_{j=1..n−1} Q_kʲ
    exact Cayley:   R_k = (I − Q_k)(I + Q_k)⁻¹    (note: the series approximates (I + Q)(I − Q)⁻¹, the other sign;
                                                   each is what PEFT computes for its setting)
    W' = W · blockdiag(R)ᵀ,  W as (out, in·∏k) in PyTorch's order (conv: in, kh, kw)
    `block_share`: one stored block (r = 1) used for all in·∏k / b blocks (told by the shapes, not the config).

Multiplier: linear, W + m·(W' − W) (PEFT defines no strength for OFT; LyCORIS' reference semantics do not apply).
The rotation mixes columns only, so W is merged in place a piece of rows at a time: no weight-sized temporary.

Options that are not in the tensors come from the file's PEFT config as scalar entries `peft_option.<name>`
(`option_entries` in algos/__init__.py); a missing one takes PEFT's default and is listed in the layout's `assumed`.
The helpers for those entries are shared by the PEFT algorithm files.

PEFT before 0.16 stored OFT as `oft_r` (block matrices, and from 0.14 an `oft_s` scale), a parametrisation PEFT
itself no longer loads (its OFTConfig refuses such configs): such a file is refused when it is loaded, with that
reason (`OLD_ALGORITHM`), rather than listed key by key as unknown.

Bypass: W' = W·Q with Q = (1 − m)·I + m·blockdiag(R)ᵀ, so W'x = W·(Qx): an input-side form mapping the layer's
input channels block by block (`oft.ChannelMap`), for Linear and 1×1 convs without groups. A conv with k > 1 rotates
blocks of the flattened (in, kh, kw) columns, which mix kernel taps: no map of the input does that (dense path).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..casting import cast, pieces
from .base import Algorithm, FormSite, Layout, ShapeError, Tensors, expect, require, rows_2d, scalar
from .oft import ChannelMap

OFT_R = "oft_R.weight"
OPTION_PREFIX = "peft_option."
# PEFT OFTConfig's defaults for the options that change the maths (peft 0.21). `series_before_0_18` is not PEFT's:
# option_entries derives it from the config's peft_version (a file without config is taken as PEFT ≥ 0.18's).
SERIES_BEFORE_0_18 = "series_before_0_18"
DEFAULTS: dict[str, float] = {"use_cayley_neumann": True, "num_cayley_neumann_terms": 5, "coft": False,
                              "eps": 6e-5, SERIES_BEFORE_0_18: False}
OPTION_KEYS = tuple(OPTION_PREFIX + name for name in DEFAULTS)
# what a trainer may have set that DEFAULTS replace (Algorithm.assumable_options)
ASSUMABLE_OPTIONS = "COFT, exact Cayley, another number of Neumann terms"


def read_options(t: Tensors, defaults: dict[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
    """The options given as `peft_option.<name>` scalars, PEFT's default for the others, and which were assumed."""
    values, assumed = {}, []
    for name, default in defaults.items():
        entry = t.get(OPTION_PREFIX + name)
        if entry is None:
            values[name] = default
            assumed.append(f"{name}={default}")
        else:
            value = scalar(t, OPTION_PREFIX + name).item()
            # NaN/Inf reaches here only in the summary (the loader refuses it in check_values); int() would raise
            expect(math.isfinite(value), f"{OPTION_PREFIX}{name} must be a finite number, got {value}",
                   OPTION_PREFIX + name)
            values[name] = type(default)(value)
    return values, tuple(assumed)


@dataclass(frozen=True)
class PeftOFTLayout(Layout):
    stored_blocks: int = 0  # rows of oft_R (1 with block_share)
    block_size: int = 0
    blocks: int = 0  # blocks across the input, known once the weight is (resolve)
    neumann: bool = True
    terms: int = 5
    series_before_0_18: bool = False
    coft: bool = False
    eps: float = 6e-5
    assumed: tuple[str, ...] = ()  # options not in the file, taken at PEFT's default
    key: str = OFT_R  # the packed rotations' key (the Embedding's is `oft_embedding_R.weight`)

    def resolve(self, weight_shape: tuple[int, ...]) -> Layout:
        flat_in = math.prod(weight_shape[1:]) if len(weight_shape) > 1 else 0
        if self.stored_blocks * self.block_size == flat_in:
            return replace(self, blocks=self.stored_blocks)
        if self.stored_blocks == 1 and flat_in and flat_in % self.block_size == 0:  # block_share
            return replace(self, blocks=flat_in // self.block_size)
        raise ShapeError(f"OFT rotates {self.stored_blocks} blocks of {self.block_size} inputs, the weight's shape "
                         f"is {list(weight_shape)}", self.key)


def block_size_of(elements: int) -> int | None:
    """b with b(b−1)/2 = elements, or None."""
    b = (1 + math.isqrt(1 + 8 * elements)) // 2
    return b if b * (b - 1) // 2 == elements and b >= 2 else None


def layout(t: Tensors, alpha: float | None, key: str = OFT_R) -> Layout:
    (packed,) = require(t, key)
    b = block_size_of(packed.shape[-1]) if packed.ndim == 2 else None
    expect(b is not None, f"{key} must be (r, b(b-1)/2), got {list(packed.shape)}", key)
    options, assumed = read_options(t, DEFAULTS)
    terms = int(options["num_cayley_neumann_terms"])
    return PeftOFTLayout(None, 1.0, out=-1, stored_blocks=packed.shape[0], block_size=b,
                         neumann=bool(options["use_cayley_neumann"]), terms=terms, coft=bool(options["coft"]),
                         eps=float(options["eps"]), series_before_0_18=bool(options[SERIES_BEFORE_0_18]),
                         assumed=assumed, key=key)


def skew(packed: torch.Tensor, b: int) -> torch.Tensor:
    """Q = U − Uᵀ per row of `packed`, U its strict upper triangle in row-major order."""
    rows, cols = torch.triu_indices(b, b, 1, device=packed.device)
    upper = packed.new_zeros(packed.shape[0], b, b)
    upper[:, rows, cols] = packed
    return upper - upper.transpose(-1, -2)


def neumann_cayley(q: torch.Tensor, terms: int, before_0_18: bool = False) -> torch.Tensor:
    eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype).expand_as(q)
    if terms <= 1:
        return eye.clone()
    rotation = eye + 2 * q
    if terms == 2:
        return rotation
    doubled = terms - 1 if before_0_18 else max(2, terms - 2)  # the last power of the series counted twice
    power = q
    for _ in range(doubled - 1):
        power = power @ q
        rotation = rotation + 2 * power
    return rotation if before_0_18 else rotation + power @ q


def exact_cayley(q: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype).expand_as(q)
    return torch.linalg.solve(eye + q, eye - q, left=False)


def rotations(packed: torch.Tensor, lay: PeftOFTLayout) -> torch.Tensor:
    """R (stored_blocks, b, b) as PEFT's get_weight builds it. The COFT clamp is a tensor op: no host read-back."""
    q = skew(packed, lay.block_size)
    if lay.coft:
        limit = lay.eps / math.sqrt(lay.stored_blocks)
        norms = torch.linalg.matrix_norm(q, keepdim=True)
        q = q * torch.clamp(limit / norms, max=1.0)
    return neumann_cayley(q, lay.terms, lay.series_before_0_18) if lay.neumann else exact_cayley(q)


def merge_rows(weight: torch.Tensor, m: float, rotate: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """W ← W + m·(rotate(W) − W) in place, a piece of rows of W₂ = (out, in·∏k) at a time; `rotate(piece, start)`
    maps the (n, in·∏k) piece starting at row `start` to a new tensor."""
    rows = rows_2d(weight)
    for start, length in pieces(rows.shape[0], rows.shape[1] * rows.element_size()):
        piece = rows[start:start + length]
        piece.lerp_(rotate(piece, start), m)


def rotate_inputs(piece: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x · blockdiag(R)ᵀ for the rows x of `piece`: x_k ← x_k R_kᵀ for each block k of b columns."""
    blocks, b = rotation.shape[0], rotation.shape[-1]
    x = piece.reshape(piece.shape[0], blocks, b)
    return torch.einsum("pkj,kcj->pkc", x, rotation).reshape(piece.shape)


def merge_into(t: Tensors, lay: PeftOFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    rotation = rotations(t[OFT_R], lay).expand(lay.blocks, lay.block_size, lay.block_size)
    merge_rows(weight, m, lambda piece, start: rotate_inputs(piece, rotation))


def input_maps(at: FormSite) -> bool:
    """Whether W·Q (Q acting on W's flattened columns) is the layer's op on a map of its input channels."""
    return at.op.groups == 1 and all(d == 1 for d in at.shape[2:])


def bypass(t: Tensors, lay: PeftOFTLayout, at: FormSite) -> ChannelMap | None:
    if not input_maps(at):
        return None
    rotation = rotations(cast(t[lay.key], at.device, torch.float32), lay).expand(lay.blocks, lay.block_size,
                                                                               lay.block_size)
    eye = torch.eye(lay.block_size, device=rotation.device)
    return ChannelMap([(None, torch.lerp(eye.expand_as(rotation), rotation.transpose(-1, -2), at.strength))], None,
                      0.0, at, input_side=True)


ALGORITHM = Algorithm(
    name="peft-oft", label="OFT (PEFT)", markers=(OFT_R,), keys=(OFT_R, *OPTION_KEYS),
    layout=layout, merge_into=merge_into, uses_alpha=False, bypass=bypass, reads_param=True,
    assumable_options=ASSUMABLE_OPTIONS,
    no_kohya_form="PEFT's OFT has no LyCORIS/kohya form with the same maths (LyCORIS' diag-OFT uses the exact "
                  "Cayley transform, PEFT a Neumann series and its own options)",
)


OLD_R, OLD_S = "oft_r", "oft_s"
OLD_REASON = ("PEFT's OFT from before PEFT 0.16 (`oft_r`): a parametrisation PEFT itself no longer loads (PEFT 0.14 "
              "and 0.16 changed it); not supported, retrain with PEFT 0.16 or newer (`oft_R`)")


def old_layout(t: Tensors, alpha: float | None) -> Layout:
    raise ShapeError(OLD_REASON, OLD_R)


OLD_ALGORITHM = Algorithm(
    name="peft-oft-old", label="OFT (PEFT < 0.16)", markers=(OLD_R,), keys=(OLD_R, OLD_S),
    layout=old_layout, uses_alpha=False,
    no_kohya_form="PEFT's old OFT has no LyCORIS/kohya form with the same maths",
)
