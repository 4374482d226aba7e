"""lycoris_core on hand-made files: layouts the 4.1.3 reference cannot produce or read back, and broken files.

Each format case writes a small .safetensors file, patches a float64 weight with a float64 intermediate, and compares
with the formula of docs/spec (lycoris-formats.md) written out here independently in float64, not with
lycoris_core's own functions. Bad inputs must raise `lycoris_core.LycorisError` naming the file (and the key, when
one key is at fault), and pickles must never be unpickled.
"""

import json
import math
import pickle
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from comfy_env import REPO_ROOT
from safetensors.torch import save_file

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended, not prepended: ComfyUI's own `nodes` must keep winning

import lycoris_core
from lycoris_core import LycorisError

STRENGTHS = (1.0, 0.5, -1.0)
F64 = torch.float64


# ------------------------------------------------------------------------------------------ independent formulas

def randn(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return std * torch.randn(shape, generator=gen, dtype=F64)


def lora_delta(up: torch.Tensor, down: torch.Tensor, shape, scale: float) -> torch.Tensor:
    """§2.1: ΔW = s·(U₂·D₂).reshape(W.shape)."""
    return scale * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape)


def kron_delta(w1: torch.Tensor, w2: torch.Tensor, scale: float) -> torch.Tensor:
    """§2.3: ΔW[i·b+p, j·d+q, …] = s·W₁[i,j]·W₂[p,q,…], written with explicit indices (no torch.kron)."""
    (a, c), (b, d), kernel = w1.shape, w2.shape[:2], w2.shape[2:]
    return scale * torch.einsum("ij,pq...->ipjq...", w1, w2).reshape(a * b, c * d, *kernel)


def cayley(blocks: torch.Tensor, constraint: float = 0.0) -> torch.Tensor:
    """§2.6: Q = B − Bᵀ, clamped to C over all blocks when C > 0; R = (I+Q)(I−Q)⁻¹."""
    q = blocks - blocks.transpose(-1, -2)
    norm = float(q.norm()) + 1e-8
    if constraint > 0 and norm > constraint:
        q = q * constraint / norm
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


def rotate_rows_transposed(rotations: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """§2.6: W'_k = R_kᵀ·W_k for each block k of b output rows, as an explicit loop over blocks."""
    n, b = rotations.shape[:2]
    out = weight.clone()
    for k in range(n):
        rows = weight[k * b:(k + 1) * b].reshape(b, -1)
        out[k * b:(k + 1) * b] = (rotations[k].T @ rows).reshape(out[k * b:(k + 1) * b].shape)
    return out


def rows_scaled(weight: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    return weight * per_row.reshape(weight.shape[0], *([1] * (weight.ndim - 1)))


def linear_strength(weight: torch.Tensor, full: torch.Tensor, m: float) -> torch.Tensor:
    """Linear semantics: W + m·(W'(1) − W)."""
    return weight + m * (full - weight)


# --------------------------------------------------------------------------------------------------- format cases

@dataclass
class Made:
    tensors: dict[str, torch.Tensor]  # what the file holds
    weight: torch.Tensor  # the target weight (float64)
    key: str  # the module key lycoris_core must report: "<prefix>.weight"
    expected: Callable[[float, bool], torch.Tensor]  # (m, reference semantics) -> W'
    semantics: tuple[bool, ...] = (False,)  # which `reference` values to test
    alpha: float | None = field(default=None)  # the alpha the module must read, when the case is about alpha


CASES: dict[str, Callable[[torch.Generator], Made]] = {}


def case(function):
    CASES[function.__name__.removeprefix("make_")] = function
    return function


def _additive(weight, delta) -> Callable[[float, bool], torch.Tensor]:
    return lambda m, reference: weight + m * delta


@case
def make_glora_old_layout(gen):
    """LyCORIS 1.x/2.x GLoRA on a Linear: a1 (r, in), a2 (in, r), b1 (r, in), b2 (out, r); ΔW = s·(W·a2·a1 + b2·b1)."""
    out, inp, r, alpha = 7, 5, 2, 1.5
    W = randn(gen, out, inp)
    t = {"a1.weight": randn(gen, r, inp, std=0.3), "a2.weight": randn(gen, inp, r, std=0.3),
         "b1.weight": randn(gen, r, inp, std=0.3), "b2.weight": randn(gen, out, r, std=0.3)}
    s = alpha / r
    delta = s * (W @ t["a2.weight"] @ t["a1.weight"] + t["b2.weight"] @ t["b1.weight"])
    return Made({**{f"lycoris_old.{k}": v for k, v in t.items()}, "lycoris_old.alpha": torch.tensor(alpha)},
                W, "lycoris_old.weight", _additive(W, delta))


@case
def make_glora_old_layout_conv1x1(gen):
    """Old GLoRA on a 1×1 conv (LyCORIS 1.x made it with Conv2d factors): the same maths on 4-D tensors,
    a1 (r, in, 1, 1), a2 (in, r, 1, 1), b1 (r, in, 1, 1), b2 (out, r, 1, 1)."""
    out, inp, r, alpha = 7, 5, 2, 1.5
    W = randn(gen, out, inp, 1, 1)
    t = {"a1.weight": randn(gen, r, inp, 1, 1, std=0.3), "a2.weight": randn(gen, inp, r, 1, 1, std=0.3),
         "b1.weight": randn(gen, r, inp, 1, 1, std=0.3), "b2.weight": randn(gen, out, r, 1, 1, std=0.3)}
    a1, a2, b1, b2 = (t[k].reshape(t[k].shape[0], -1) for k in ("a1.weight", "a2.weight", "b1.weight", "b2.weight"))
    delta = (alpha / r) * (W.reshape(out, inp) @ a2 @ a1 + b2 @ b1).reshape(W.shape)
    return Made({**{f"lora_unet_proj.{k}": v for k, v in t.items()}, "lora_unet_proj.alpha": torch.tensor(alpha)},
                W, "lora_unet_proj.weight", _additive(W, delta))


def _glora_square(gen, old: bool) -> Made:
    n, r, alpha = 6, 2, 3.0
    W = randn(gen, n, n)
    if old:
        t = {"a1.weight": randn(gen, r, n, std=0.3), "a2.weight": randn(gen, n, r, std=0.3),
             "b1.weight": randn(gen, r, n, std=0.3), "b2.weight": randn(gen, n, r, std=0.3)}
        delta = (alpha / r) * (W @ t["a2.weight"] @ t["a1.weight"] + t["b2.weight"] @ t["b1.weight"])
    else:
        t = {"a1.weight": randn(gen, n, r, std=0.3), "a2.weight": randn(gen, r, n, std=0.3),
             "b1.weight": randn(gen, n, r, std=0.3), "b2.weight": randn(gen, r, n, std=0.3)}
        delta = (alpha / r) * (W @ t["a1.weight"] @ t["a2.weight"] + t["b1.weight"] @ t["b2.weight"])
    a1, a2, b1, b2 = (t[k].shape for k in ("a1.weight", "a2.weight", "b1.weight", "b2.weight"))
    # the case is only meaningful because both layouts' rank equalities hold (only "== out" tells them apart)
    assert a2[0] == b2[0] == a1[1] == b1[1] and a1[0] == b1[0] == a2[1] == b2[1]
    return Made({**{f"lycoris_sq.{k}": v for k, v in t.items()}, "lycoris_sq.alpha": torch.tensor(alpha)},
                W, "lycoris_sq.weight", _additive(W, delta))


@case
def make_glora_square_new_layout(gen):
    return _glora_square(gen, old=False)


@case
def make_glora_square_old_layout(gen):
    return _glora_square(gen, old=True)


def _lokr_full(gen, kernel: tuple[int, ...]) -> Made:
    """Both factors full, lokr_w2 N-D (b, d, *k); alpha ≠ r is ignored (s = 1)."""
    (a, c), (b, d) = (2, 2), (4, 3)
    W = randn(gen, a * b, c * d, *kernel)
    w1, w2 = randn(gen, a, c, std=0.5), randn(gen, b, d, *kernel, std=0.5)
    tensors = {"lycoris_k.lokr_w1": w1, "lycoris_k.lokr_w2": w2, "lycoris_k.alpha": torch.tensor(0.5)}
    return Made(tensors, W, "lycoris_k.weight", _additive(W, kron_delta(w1, w2, 1.0)))


def _lokr_tucker(gen, kernel: tuple[int, ...]) -> Made:
    """lokr_t2 (r, r, *k) with the transposed lokr_w2_a (r, b), lokr_w2_b (r, d); s = alpha / r."""
    (a, c), (b, d), r, alpha = (2, 2), (4, 3), 2, 1.0
    W = randn(gen, a * b, c * d, *kernel)
    w1 = randn(gen, a, c, std=0.5)
    t2, w2a, w2b = randn(gen, r, r, *kernel, std=0.5), randn(gen, r, b, std=0.5), randn(gen, r, d, std=0.5)
    w2 = torch.einsum("ij...,ip,jr->pr...", t2, w2a, w2b)  # §2.3 (c)
    tensors = {"lycoris_k.lokr_w1": w1, "lycoris_k.lokr_t2": t2, "lycoris_k.lokr_w2_a": w2a,
               "lycoris_k.lokr_w2_b": w2b, "lycoris_k.alpha": torch.tensor(alpha)}
    return Made(tensors, W, "lycoris_k.weight", _additive(W, kron_delta(w1, w2, alpha / r)))


@case
def make_lokr_conv1d_full_w2(gen):
    return _lokr_full(gen, (3,))


@case
def make_lokr_conv3d_full_w2(gen):
    return _lokr_full(gen, (3, 3, 3))


@case
def make_lokr_conv1d_tucker(gen):
    return _lokr_tucker(gen, (3,))


@case
def make_lokr_conv3d_tucker(gen):
    return _lokr_tucker(gen, (3, 2, 3))


@case
def make_peft_lora(gen):
    """PEFT/diffusers: dotted prefix, lora_A (r, in) / lora_B (out, r), no alpha in the file → s = 1."""
    W, A, B = randn(gen, 6, 5), randn(gen, 3, 5, std=0.5), randn(gen, 6, 3, std=0.5)
    prefix = "base_model.model.transformer.blocks.0.attn.to_q"
    return Made({f"{prefix}.lora_A.weight": A, f"{prefix}.lora_B.weight": B}, W, f"{prefix}.weight",
                _additive(W, lora_delta(B, A, W.shape, 1.0)))


@case
def make_peft_dora_magnitude_vector(gen):
    """PEFT DoRA: 1-D lora_magnitude_vector (out,), per output row (§2.5, out-axis), V = W + B·A."""
    W, A, B = randn(gen, 6, 5), randn(gen, 2, 5, std=0.5), randn(gen, 6, 2, std=0.5)
    magnitude = W.norm(dim=1) * (1 + 0.2 * randn(gen, 6))
    V = W + B @ A
    gain = (magnitude / (V.norm(dim=1) + torch.finfo(F64).eps)).reshape(6, 1)

    def expected(m, reference):
        return V * (m * (gain - 1) + 1) if reference else W + m * (V * gain - W)

    prefix = "unet.down_blocks.0.attentions.0.proj_in"
    return Made({f"{prefix}.lora_A.weight": A, f"{prefix}.lora_B.weight": B, f"{prefix}.lora_magnitude_vector": magnitude},
                W, f"{prefix}.weight", expected, semantics=(False, True))


def _orthogonal(gen, n: int, b: int) -> torch.Tensor:
    return torch.linalg.qr(randn(gen, n, b, b))[0]


@case
def make_oft_diag_stores_r(gen):
    """LyCORIS 2.0.x `oft_diag` (n, b, b) is R itself: W'_k = R_kᵀ·W_k; multiplier I + m(R − I); no alpha."""
    W = randn(gen, 8, 4, 3, 3)
    R = _orthogonal(gen, 2, 4)
    eye = torch.eye(4, dtype=F64)

    def expected(m, reference):
        return rotate_rows_transposed(eye + m * (R - eye), W)  # linear in m: both semantics agree

    return Made({"lora_unet_conv.oft_diag": R}, W, "lora_unet_conv.weight", expected, semantics=(False, True))


@case
def make_oft_2_1_0_no_alpha_1d_rescale(gen):
    """2.1.0-era Diag-OFT: no alpha (no clamp, however large ‖Q‖), rescale 1-D (out,) on a conv weight."""
    W = randn(gen, 8, 3, 3, 3)
    blocks, rescale = randn(gen, 2, 4, 4, std=0.3), 1 + 0.1 * randn(gen, 8)
    R = cayley(blocks)  # unconstrained
    eye = torch.eye(4, dtype=F64)

    def expected(m, reference):
        if reference:  # I + m(R − I); the rescale is not interpolated
            return rows_scaled(rotate_rows_transposed(eye + m * (R - eye), W), rescale)
        return linear_strength(W, rows_scaled(rotate_rows_transposed(R, W), rescale), m)

    return Made({"lycoris_o.oft_blocks": blocks, "lycoris_o.rescale": rescale}, W, "lycoris_o.weight", expected,
                semantics=(False, True))


@case
def make_dylora_conv_2d_up(gen):
    """LyCORIS-DyLoRA on a conv saves lora_up 2-D (out, r); it is plain LoRA with s = alpha / r."""
    W, down, up, alpha = randn(gen, 6, 4, 3, 3), randn(gen, 4, 4, 3, 3, std=0.3), randn(gen, 6, 4, std=0.3), 2.0
    return Made({"lycoris_dy.lora_up.weight": up, "lycoris_dy.lora_down.weight": down,
                 "lycoris_dy.alpha": torch.tensor(alpha)}, W, "lycoris_dy.weight",
                _additive(W, lora_delta(up, down, W.shape, alpha / 4)))


def _lora_with_alpha(gen, alpha: torch.Tensor) -> Made:
    W, down, up, r = randn(gen, 6, 5), randn(gen, 3, 5, std=0.5), randn(gen, 6, 3, std=0.5), 3
    stored = float(alpha.reshape(-1)[0])  # read as stored (bf16-rounded, int), like the reference's float(alpha)
    return Made({"lycoris_a.lora_up.weight": up, "lycoris_a.lora_down.weight": down, "lycoris_a.alpha": alpha},
                W, "lycoris_a.weight", _additive(W, lora_delta(up, down, W.shape, stored / r)), alpha=stored)


@case
def make_alpha_bf16_0d(gen):
    made = _lora_with_alpha(gen, torch.tensor(0.1, dtype=torch.bfloat16))
    assert made.alpha != 0.1  # the spec's example: stored as 0.10009765625, and that is the alpha
    return made


@case
def make_alpha_int64_0d(gen):
    return _lora_with_alpha(gen, torch.tensor(2, dtype=torch.int64))


@case
def make_alpha_shape_1(gen):
    return _lora_with_alpha(gen, torch.tensor([1.5]))  # extract_diff's torch.Tensor([dim])


def _write(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("case_id", list(CASES))
def test_hand_made_format_matches_the_spec_formula(tmp_path, case_id, strength):
    made = CASES[case_id](torch.Generator().manual_seed(sum(map(ord, case_id))))
    lycoris_file = lycoris_core.load(_write(tmp_path, case_id, made.tensors))
    assert lycoris_file.unused == []
    assert list(lycoris_file.modules) == [made.key]
    module = lycoris_file.modules[made.key]
    if made.alpha is not None:
        assert module.alpha == made.alpha
    for reference in made.semantics:
        weight = made.weight.clone()
        plan = module.plan_for(tuple(weight.shape), reference=reference)
        lycoris_core.apply(plan, module.tensors, weight, strength, intermediate_dtype=F64)
        expected = made.expected(strength, reference)
        assert not torch.allclose(expected, made.weight), "the case must change the weight"
        torch.testing.assert_close(weight, expected, rtol=1e-12, atol=1e-12,
                                   msg=lambda text, reference=reference: f"{case_id}, reference={reference}: {text}")


# ------------------------------------------------------------------------------------------------------ bad files

def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _valid(tmp_path: Path, name: str, **overrides: torch.Tensor) -> Path:
    tensors = {"lycoris_x.lora_up.weight": torch.ones(4, 2), "lycoris_x.lora_down.weight": torch.ones(2, 3),
               "lycoris_x.alpha": torch.tensor(1.0)}
    tensors.update({f"lycoris_x.{k}": v for k, v in overrides.items()})
    return _write(tmp_path, name, tensors)


def _truncated(tmp_path):
    path = _valid(tmp_path, "truncated")
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    return path, last


def _overlapping(tmp_path):
    entry = {"dtype": "F32", "shape": [2, 2]}
    header = {"x.lora_up.weight": {**entry, "data_offsets": [0, 16]},
              "x.lora_down.weight": {**entry, "data_offsets": [8, 24]}}
    return _raw_safetensors(tmp_path / "overlap.safetensors", header, bytes(24)), "x.lora_down.weight"


def _nan(tmp_path):
    up = torch.ones(4, 2)
    up[1, 1] = float("nan")
    return _valid(tmp_path, "nan", **{"lora_up.weight": up}), "lycoris_x.lora_up.weight"


def _inf(tmp_path):
    return _valid(tmp_path, "inf", alpha=torch.tensor(float("inf"))), "lycoris_x.alpha"


def _raw_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _raw_header(path: Path, header: str, data: bytes = b"") -> Path:
    """A file whose header is this JSON text as written (numbers and nesting no JSON encoder here would write)."""
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _zero_size_alpha(tmp_path):
    tensors = {"lycoris_x.lora_up.weight": torch.ones(4, 2), "lycoris_x.lora_down.weight": torch.ones(2, 3),
               "lycoris_x.alpha": torch.ones(0)}
    return _write(tmp_path, "zero_alpha", tensors), "lycoris_x.alpha"


ENTRY = '"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'
BAD_FILES: dict[str, Callable[[Path], tuple[Path, str | None]]] = {
    # issue #11's cases that escaped as a bare OverflowError / RecursionError / ValueError / IndexError
    "shape of 1e400": lambda tmp: (_raw_header(tmp / "huge_shape.safetensors", '{"x.alpha": {"dtype": "F32", '
                                               '"shape": [1e400], "data_offsets": [0, 4]}}', bytes(4)), "x.alpha"),
    "header nested 100k deep": lambda tmp: (_raw_header(tmp / "deep.safetensors", '{"x.alpha": {' + ENTRY + '}, '
                                                        '"__metadata__": {"a": ' + "[" * 100_000 + "]" * 100_000
                                                        + "}}", bytes(4)), None),
    "5000-digit integer": lambda tmp: (_raw_header(tmp / "digits.safetensors", '{"x.alpha": {"dtype": "F32", '
                                                   '"shape": [1], "data_offsets": [0, ' + "9" * 5000 + "]}}",
                                                   bytes(4)), None),
    "zero-size alpha": _zero_size_alpha,
    "empty file": lambda tmp: (_raw_bytes(tmp / "empty.safetensors", b""), None),
    "shorter than the header length": lambda tmp: (_raw_bytes(tmp / "short.safetensors", b"\x10\x00\x00"), None),
    "header length past the end": lambda tmp: (_raw_bytes(tmp / "long.safetensors",
                                                          struct.pack("<Q", 1 << 20) + b"{}"), None),
    "corrupt header": lambda tmp: (_raw_bytes(tmp / "corrupt.safetensors", struct.pack("<Q", 9) + b"{not json"),
                                   None),
    "header not an object": lambda tmp: (_raw_safetensors(tmp / "list.safetensors", [], b""), None),
    "no tensors": lambda tmp: (_raw_safetensors(tmp / "none.safetensors", {}, b""), None),
    "truncated data": _truncated,
    "overlapping offsets": _overlapping,
    "NaN tensor": _nan,
    "Inf tensor": _inf,
}


@pytest.mark.parametrize("case_id", list(BAD_FILES))
def test_broken_file_is_refused_naming_file_and_key(tmp_path, case_id):
    path, key = BAD_FILES[case_id](tmp_path)
    with pytest.raises(LycorisError) as error:
        lycoris_core.load(path)
    message = str(error.value)
    assert path.name in message
    if key is not None:
        assert key in message


def test_error_text_is_bounded_and_still_names_the_file(tmp_path):
    """A 1 MB key name in a corrupt entry: the error names the file and the start of the key, within a few kB."""
    key = "lycoris_" + "k" * 1_000_000
    path = _raw_header(tmp_path / "long_key.safetensors", '{"' + key + '": {"dtype": "F32", "shape": "x"}}')
    with pytest.raises(LycorisError) as error:
        lycoris_core.load(path)
    message = str(error.value)
    assert message.startswith(f"{path.name}: lycoris_kkk") and len(message) < 2_000, len(message)
    assert "more characters" in message


class _WritesMarker:
    """Unpickling this creates the marker file: proof that a loader ran pickle code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("name", ["adapter.ckpt", "adapter.pt", "adapter.pth", "adapter.bin", "pickle.safetensors"])
def test_pickles_are_refused_without_unpickling(tmp_path, name):
    marker = tmp_path / "unpickled.marker"
    path = tmp_path / name
    path.write_bytes(pickle.dumps({"lycoris_x.lora_up.weight": _WritesMarker(marker)}))
    with pytest.raises(LycorisError) as error:
        lycoris_core.load(path)
    assert path.name in str(error.value)
    assert not marker.exists(), "the file was unpickled"
    pickle.loads(path.read_bytes())["lycoris_x.lora_up.weight"].close()  # the check can fail: unpickling
    assert marker.exists()  # really does write the marker


def test_unknown_keys_are_reported_unused(tmp_path):
    path = _write(tmp_path, "extra", {
        "lycoris_x.lora_up.weight": torch.ones(4, 2), "lycoris_x.lora_down.weight": torch.ones(2, 3),
        "lycoris_x.rescale": torch.ones(4),  # a known suffix LoCon does not read
        "lycoris_x.some_future_key": torch.ones(1),  # no known suffix at all
        "lycoris_y.hada_t1": torch.ones(2, 2, 3),  # a group no algorithm matches
    })
    lycoris_file = lycoris_core.load(path)
    assert list(lycoris_file.modules) == ["lycoris_x.weight"]
    assert sorted(u.key for u in lycoris_file.unused) == ["lycoris_x.rescale", "lycoris_x.some_future_key",
                                                          "lycoris_y.hada_t1"]
    assert all(u.reason for u in lycoris_file.unused)


# Internally inconsistent modules: refused at load, naming the file and one of the module's keys.
INCONSISTENT: dict[str, dict[str, torch.Tensor]] = {
    "lora rank": {"lora_up.weight": torch.ones(4, 3), "lora_down.weight": torch.ones(2, 5)},
    "lora mid": {"lora_up.weight": torch.ones(4, 2, 1, 1), "lora_down.weight": torch.ones(2, 3, 1, 1),
                 "lora_mid.weight": torch.ones(3, 3, 3, 3)},
    "loha factors": {"hada_w1_a": torch.ones(4, 2), "hada_w1_b": torch.ones(2, 5), "hada_w2_a": torch.ones(4, 2),
                     "hada_w2_b": torch.ones(2, 6)},
    "lokr w1 factors": {"lokr_w1_a": torch.ones(2, 2), "lokr_w1_b": torch.ones(3, 2), "lokr_w2": torch.ones(2, 2)},
    "lokr tucker": {"lokr_w1": torch.ones(2, 2), "lokr_t2": torch.ones(2, 2, 3, 3), "lokr_w2_a": torch.ones(3, 4),
                    "lokr_w2_b": torch.ones(2, 4)},
    "glora factors": {"a1.weight": torch.ones(5, 2), "a2.weight": torch.ones(3, 5), "b1.weight": torch.ones(6, 2),
                      "b2.weight": torch.ones(2, 5)},
    "oft blocks not square": {"oft_blocks": torch.ones(2, 4, 3)},
    "boft block count not a power of two": {"oft_blocks": torch.ones(2, 3, 4, 4)},
    "oft rescale length": {"oft_blocks": torch.ones(2, 4, 4), "rescale": torch.ones(7, 1)},
}


@pytest.mark.parametrize("case_id", list(INCONSISTENT))
def test_inconsistent_shapes_are_refused_naming_file_and_key(tmp_path, case_id):
    tensors = {f"lycoris_bad.{k}": v for k, v in INCONSISTENT[case_id].items()}
    path = _write(tmp_path, "inconsistent", tensors)
    with pytest.raises(LycorisError) as error:
        lycoris_core.load(path)
    message = str(error.value)
    assert path.name in message
    assert any(key in message for key in tensors), message


# Modules that are consistent but do not fit the target weight: refused by plan_for, naming the file and key.
MISFITS: dict[str, tuple[dict[str, torch.Tensor], tuple[int, ...]]] = {
    "lora for another weight": ({"lora_up.weight": torch.ones(4, 2), "lora_down.weight": torch.ones(2, 3)}, (4, 5)),
    "dora_scale fits neither axis": ({"lora_up.weight": torch.ones(4, 2), "lora_down.weight": torch.ones(2, 3),
                                      "dora_scale": torch.ones(1, 4)}, (4, 3)),
    "ia3 for another width": ({"weight": torch.ones(5), "on_input": torch.tensor(0)}, (4, 3)),
}


@pytest.mark.parametrize("case_id", list(MISFITS))
def test_module_that_does_not_fit_the_weight_is_refused(tmp_path, case_id):
    tensors, weight_shape = MISFITS[case_id]
    tensors = {f"lycoris_bad.{k}": v for k, v in tensors.items()}
    path = _write(tmp_path, "misfit", tensors)
    lycoris_file = lycoris_core.load(path)
    (module,) = lycoris_file.modules.values()
    with pytest.raises(LycorisError) as error:
        module.plan_for(weight_shape, file=lycoris_file.name)
    message = str(error.value)
    assert path.name in message
    assert "lycoris_bad" in message


def test_two_keys_meaning_the_same_tensor_are_refused(tmp_path):
    path = _write(tmp_path, "aliases", {"m.lora_up.weight": torch.ones(4, 2), "m.lora_B.weight": torch.ones(4, 2),
                                        "m.lora_down.weight": torch.ones(2, 3)})
    with pytest.raises(LycorisError) as error:
        lycoris_core.load(path)
    assert path.name in str(error.value)
    assert any(key in str(error.value) for key in ("m.lora_up.weight", "m.lora_B.weight"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("where", [0, 777, -1])
def test_all_finite_finds_any_bad_value(dtype, bad, where):
    """The load-time value check, for every float dtype a file may hold (fp8 files crashed it before)."""
    from lycoris_nodes.lycoris_core.lycoris_file import all_finite

    values = torch.randn(1000, generator=torch.Generator().manual_seed(where % 7)).to(dtype)
    if bad is not None:
        values[where] = torch.tensor(bad).to(dtype)  # e4m3fn has no infinity: ±inf saturates to ±448 there
    finite = bool(torch.isfinite(values.double()).all())  # the elementwise truth
    assert all_finite(values) is finite
    assert finite is (bad is None or (dtype == torch.float8_e4m3fn and not math.isnan(bad)))
