"""PEFT's BOFT (`boft_R`, `boft_s`): butterfly orthogonal fine-tuning on the weight's INPUT side, then a scale per
output channel.

    `boft_R` (N, D, b, b): N butterfly factors, each D blocks of b×b;  `boft_s`: out values ((out, 1), conv (1, out))
    R_{i,k} = (I − Q)(I + Q)⁻¹,  Q = ½(A_{i,k} − A_{i,k}ᵀ)                                     (exact Cayley)
    M_i = P_i · blockdiag(R_i) · P_iᵀ,   M = M_{N−1} ⋯ M_0
    W' = s ⊙ (W · Mᵀ),   W as (out, in·∏k) in PyTorch's order (conv: in, kh, kw)

P_i is the butterfly permutation of factor i (identity when N = 1): the inputs are cut into chunks of b·2ⁱ, each
chunk into groups of b/2, and a chunk's groups are reordered even-numbered first, then odd-numbered (P[j, π(j)] = 1).
Everything is told by the shapes (N = `boft_n_butterfly_factor`, D = `boft_block_num`, b = `boft_block_size`): no
option of the config changes the maths. PEFT's merge scales the weight only, not the bias.

Multiplier: linear, W + m·(W' − W) (PEFT defines no strength for BOFT).
Every factor mixes columns only, so W is merged in place a piece of rows at a time (peft_oft.merge_rows).

Bypass at strength 1: W'x = s ⊙ (W·(Mᵀx)), an input-side form mapping the input channels by
Mᵀ = M_0ᵀ ⋯ M_{N−1}ᵀ (each factor a gather, a block product, a gather; `oft.ChannelMap`), the scale kept on the
output with the bias (s ⊙ (y − b) + b); Linear and 1×1 convs without groups only (peft_oft). Other strengths take the
dense path: (1 − m)·W + m·s ⊙ (W·Mᵀ) needs two products with W (for s all ones it would be one map, but telling that
reads s back to the host).
"""

from dataclasses import dataclass

import torch

from ..casting import cast
from .base import Algorithm, Form, FormSite, Layout, Tensors, expect, require
from .ia3 import ChannelScale
from .oft import ChannelMap, Stage
from .peft_oft import input_maps, merge_rows

BLOCKS, SCALE = "boft_R", "boft_s"


@dataclass(frozen=True)
class PeftBOFTLayout(Layout):
    factors: int = 0
    blocks: int = 0
    block_size: int = 0


def layout(t: Tensors, alpha: float | None) -> Layout:
    blocks, scale = require(t, BLOCKS, SCALE)
    expect(blocks.ndim == 4 and blocks.shape[2] == blocks.shape[3],
           f"boft_R must be (N, D, b, b), got {list(blocks.shape)}", BLOCKS)
    n, d, b = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    expect(n >= 1 and (n == 1 or (b % 2 == 0 and d % 2 ** (n - 1) == 0)),
           f"boft_R's {n} butterfly factors need an even block size and a block count divisible by {2 ** (n - 1)}, "
           f"got {list(blocks.shape)}", BLOCKS)
    expect(scale.ndim == 2 and 1 in scale.shape, f"boft_s must be (out, 1) or (1, out), got {list(scale.shape)}",
           SCALE)
    return PeftBOFTLayout(None, 1.0, out=scale.numel(), flat_in=d * b, factors=n, blocks=d, block_size=b)


def butterfly_order(length: int, factor: int, block_size: int, device: torch.device) -> torch.Tensor:
    """π of factor i: within each chunk of b·2ⁱ inputs, its groups of b/2 taken even-numbered first, then odd."""
    group, chunk = block_size // 2, block_size * 2 ** factor
    groups = chunk // group
    order = torch.cat([torch.arange(0, groups, 2), torch.arange(1, groups, 2)])
    within = (order[:, None] * group + torch.arange(group)[None, :]).reshape(-1)
    return (torch.arange(0, length, chunk)[:, None] + within[None, :]).reshape(-1).to(device)


def rotations(blocks: torch.Tensor) -> torch.Tensor:
    q = 0.5 * (blocks - blocks.transpose(-1, -2))
    eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype).expand_as(q)
    return torch.linalg.solve(eye + q, eye - q, left=False)


def butterfly_inputs(piece: torch.Tensor, rotation: torch.Tensor, orders: list[torch.Tensor | None]) -> torch.Tensor:
    """x · M_0ᵀ M_1ᵀ ⋯ for the rows x of `piece`, x·M_iᵀ = ((x·P_i) · blockdiag(R_i)ᵀ) · P_iᵀ."""
    x = piece
    for factor, order in zip(rotation, orders):
        if order is not None:
            x = x[:, torch.argsort(order)]  # x*P: (x*P)[pi(j)] = x[j]
        blocks, b = factor.shape[0], factor.shape[-1]
        x = torch.einsum("pkj,kcj->pkc", x.reshape(x.shape[0], blocks, b), factor).reshape(x.shape)
        if order is not None:
            x = x[:, order]  # x*P^T: (x*P^T)[j] = x[pi(j)]
    return x


def merge_into(t: Tensors, lay: PeftBOFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    rotation = rotations(t[BLOCKS])
    length = lay.blocks * lay.block_size
    orders = [None if lay.factors == 1 else butterfly_order(length, i, lay.block_size, weight.device)
              for i in range(lay.factors)]
    scale = t[SCALE].reshape(-1, 1)

    def rotate(piece: torch.Tensor, start: int) -> torch.Tensor:
        return butterfly_inputs(piece, rotation, orders).mul_(scale[start:start + piece.shape[0]])

    merge_rows(weight, m, rotate)


def input_stages(rotation: torch.Tensor, orders: list[torch.Tensor | None]) -> tuple[list[Stage], torch.Tensor | None]:
    """Mᵀ as mix_channels' stages on a column x: Mᵀx = M_0ᵀ(⋯(M_{N−1}ᵀx)), M_iᵀ = P_i · blockdiag(R_i)ᵀ · P_iᵀ,
    with P_iᵀx = x[argsort(π)] and P_i x = x[π] (butterfly_inputs' convention, transposed); the gathers between
    factors composed into one."""
    runs, pending = [], None  # pending: the gather P_{i+1} not yet applied
    for factor, order in reversed(list(zip(rotation, orders))):
        gather = None if order is None else torch.argsort(order)
        if pending is not None:
            gather = pending if gather is None else pending[gather]
        runs.append((gather, factor.transpose(-1, -2)))
        pending = order
    return runs, pending


class Rotated(Form):
    """W'x = scale ⊙ (W·(Q x)): an input map and an output channel scale that keeps the bias."""

    input_side = True

    def __init__(self, rotate: ChannelMap, scale: ChannelScale):
        self.rotate, self.scale = rotate, scale

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotate.input(x)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.scale.output(y, x)


def bypass(t: Tensors, lay: PeftBOFTLayout, at: FormSite) -> Rotated | None:
    if at.strength != 1 or not input_maps(at):
        return None
    rotation = rotations(cast(t[BLOCKS], at.device, torch.float32))
    length = lay.blocks * lay.block_size
    orders = [None if lay.factors == 1 else butterfly_order(length, i, lay.block_size, rotation.device)
              for i in range(lay.factors)]
    runs, last = input_stages(rotation, orders)
    scale = cast(t[SCALE], at.device, torch.float32).reshape(-1)
    return Rotated(ChannelMap(runs, last, 0.0, at, input_side=True), ChannelScale(scale, 0, at))


ALGORITHM = Algorithm(
    name="peft-boft", label="BOFT (PEFT)", markers=(BLOCKS,), keys=(BLOCKS, SCALE),
    layout=layout, merge_into=merge_into, uses_alpha=False, bypass=bypass, reads_param=True,
    no_kohya_form="PEFT's BOFT has no LyCORIS/kohya form with the same maths",
)
