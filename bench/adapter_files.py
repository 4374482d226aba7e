"""Full-coverage adapter files in LyCORIS/kohya key format, handed unchanged to both loaders, and the least work each
patch needs (bytes moved, FLOPs) for the machine floor.

Algorithms are named `<kind>_<r|f><n>`; shapes follow what LyCORIS writes for a Linear weight (out, in) and a Conv
weight (out, in, k, k):

- locon_r32: lora_up (out, r[,1,1]), lora_down (r, in[,k,k]), alpha = r/2
- locon_dora_r32: the same + dora_scale (out, 1[,1,1]) (output axis, the LyCORIS >= 3.2 default)
- loha_r16: hada_w1_a/hada_w2_a (out, r), hada_w1_b/hada_w2_b (r, in·k·k), alpha = r/2
- lokr_f8: lokr_w1 (out_l, in_m), lokr_w2 (out_k, in_n[,k,k]), both full (LyCORIS' "full dimension" preset) with
  (out_l, out_k) = factorization(out, 8), (in_m, in_n) = factorization(in, 8)
- glora_r16 (LyCORIS >= 3 layout): a1 (in, r[,1,1]), a2 (r, in[,1,1]), b1 (out, r[,1,1]), b2 (r, in[,k,k])
- oft_r32 (diag-OFT): oft_blocks (n, b, b) with (b, n) = factorization(out, 32), alpha (constraint) = 0
- boft_r32 (BOFT): oft_blocks (M, n, b, b) with (b, n) = power2factorization(out, 32) as LyCORIS' butterfly_factor
  picks them (b even, n a power of two; 1280 -> 64 blocks of 20, 7 stages) and M = log2(n) + 1, alpha = 0
- ia3: weight (out,) for Linear, (1, out, 1, 1) for Conv, on_input = 0 (LyCORIS' default: output channels);
  ComfyUI has no (IA)³ adapter, so the built-in side of its rows is missing

Checked against lycoris-lora 4.1.3 (`create_lycoris(..., algo="boft"/"ia3")` on 320→1280 Linear and 320→640/4 Conv
layers): the same key names, shapes and block choice. Saved files are fp16 throughout (LyCORIS' save_weights casts
every tensor, on_input too).
"""

import math

import torch
from comfy.weight_adapter.base import factorization


def power2factorization(dimension: int, factor: int) -> tuple[int, int]:
    """(block size b, block count n) of a BOFT layer with `dimension` outputs, as LyCORIS picks them
    (lycoris.functional.general.power2factorization): the largest even b <= factor dividing `dimension` whose
    n = dimension / b is a power of two."""
    best = None
    for b in range(2, factor + 1, 2):
        n, rest = divmod(dimension, b)
        if rest == 0 and n & (n - 1) == 0:
            best = (b, n)
    if best is None:
        raise ValueError(f"BOFT cannot split {dimension} channels with factor {factor}")
    return best

ALGORITHMS = ("locon_r32", "locon_dora_r32", "loha_r16", "lokr_f8", "glora_r16", "oft_r32", "boft_r32", "ia3")
NO_BUILTIN = frozenset({"ia3"})  # formats comfy.lora.load_lora does not read
FP16 = torch.float16


def _rand(gen: torch.Generator, *shape: int, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(FP16)


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=FP16)


def parse(algo: str) -> tuple[str, int]:
    """"locon_dora_r32" -> ("locon_dora", 32): the kind and its rank (r), LoKr factor (f) or (B)OFT block-size
    factor; "ia3" has none (0)."""
    if "_" not in algo:
        return algo, 0
    kind, param = algo.rsplit("_", 1)
    return kind, int(param[1:])


def module_tensors(algo: str, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """suffix -> tensor (fp16) of one module patching a weight of `shape`."""
    out, inp, kernel = shape[0], shape[1], tuple(shape[2:])
    ones = (1,) * len(kernel)
    kind, r = parse(algo)
    if kind in ("locon", "locon_dora"):
        t = {"lora_up.weight": _rand(gen, out, r, *ones), "lora_down.weight": _rand(gen, r, inp, *kernel),
             "alpha": _scalar(r / 2)}
        if kind == "locon_dora":
            # about the row norms of the weights run.py makes (std 0.02), so W' stays of the same size
            norm = 0.02 * math.sqrt(inp * math.prod(kernel))
            t["dora_scale"] = (norm * (1 + 0.1 * torch.randn((out, 1, *ones), generator=gen))).to(FP16)
        return t
    if kind == "loha":
        flat = inp * math.prod(kernel)
        # std 0.1: the Hadamard product of two rank-16 products then changes W (std 0.02) by ~4%, as LoCon's does;
        # at 0.02 the change would sit below fp16's resolution of W and no forward could show it
        return {"hada_w1_a": _rand(gen, out, r, std=0.1), "hada_w1_b": _rand(gen, r, flat, std=0.1),
                "hada_w2_a": _rand(gen, out, r, std=0.1), "hada_w2_b": _rand(gen, r, flat, std=0.1),
                "alpha": _scalar(r / 2)}
    if kind == "lokr":
        (out_l, out_k), (in_m, in_n) = factorization(out, r), factorization(inp, r)
        return {"lokr_w1": _rand(gen, out_l, in_m, std=0.1), "lokr_w2": _rand(gen, out_k, in_n, *kernel, std=0.1),
                "alpha": _scalar(1.0)}
    if kind == "glora":
        return {"a1.weight": _rand(gen, inp, r, *ones), "a2.weight": _rand(gen, r, inp, *ones),
                "b1.weight": _rand(gen, out, r, *ones), "b2.weight": _rand(gen, r, inp, *kernel),
                "alpha": _scalar(r / 2)}
    if kind == "oft":
        block_size, blocks = factorization(out, r)
        return {"oft_blocks": _rand(gen, blocks, block_size, block_size, std=0.01), "alpha": _scalar(0.0)}
    if kind == "boft":
        block_size, blocks = power2factorization(out, r)
        stages = blocks.bit_length()  # log2(n) + 1 for n a power of two (LyCORIS: popcount(n - 1) + 1)
        return {"oft_blocks": _rand(gen, stages, blocks, block_size, block_size, std=0.01), "alpha": _scalar(0.0)}
    if kind == "ia3":
        scales = _rand(gen, out, std=0.1)
        return {"weight": scales.reshape(1, out, *ones) if kernel else scales, "on_input": _scalar(0.0)}
    raise ValueError(f"unknown algorithm {algo}")


def state_dict(algo: str, shapes: dict[str, tuple[int, ...]], key_map: dict[str, str], seed: int = 0
               ) -> dict[str, torch.Tensor]:
    """One file's tensors for every weight in `shapes` (model key -> shape), under the prefixes of `key_map`."""
    gen = torch.Generator().manual_seed(seed)
    prefix_of = {model_key: prefix for prefix, model_key in key_map.items()}
    return {f"{prefix_of[key]}.{suffix}": tensor
            for key, shape in shapes.items() for suffix, tensor in module_tensors(algo, shape, gen).items()}


def file_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def work(algo: str, shape: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(bytes, FLOPs) of the least work a patch of this weight needs: read and write the fp32 weight once, read the
    factors once, and the arithmetic of the change (r = rank, N = weight elements)."""
    n = math.prod(shape)
    moved = 8 * n + sum(t.numel() * t.element_size() for t in tensors.values())
    kind, r = parse(algo)
    flops = {
        "locon": lambda: 2 * n * r + n,  # up @ down, add
        "locon_dora": lambda: 2 * n * r + 5 * n,  # + row norms of W + ΔW (2N), the gain and the blend
        "loha": lambda: 2 * (2 * n * r) + 2 * n,  # two rank-r products, Hadamard, add
        "lokr": lambda: 2 * n,  # Kronecker product elements, add
        "glora": lambda: 3 * (2 * n * r) + 2 * n,  # W a1, (W a1) a2, b1 b2, add
        "oft": lambda: 2 * n * factorization(shape[0], r)[0] + n,  # block rotation of the rows, add
        "boft": lambda: 2 * n * _boft_work(shape[0], r) + n,  # one block rotation of the rows per stage, add
        "ia3": lambda: 2 * n,  # scale and add
    }[kind]()
    return moved, flops


def _boft_work(out: int, r: int) -> int:
    """Block size × stages: the multiply-adds per weight element of a BOFT rotation."""
    b, blocks = power2factorization(out, r)
    return b * blocks.bit_length()
