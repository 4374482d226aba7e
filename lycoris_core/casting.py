"""The one place where patch tensors change device or dtype.

Patch tensors stay where and as they were loaded (usually CPU, file dtype). At the moment a patch is computed, each
small tensor (a factor) is cast to the patched weight's device and to the compute dtype; the maths runs there and the
result is cast once to the weight's dtype. A tensor as large as the weight (Full's `diff`) is never cast whole: it is
added in pieces (`add_scaled`). Casting never mutates the stored tensor, so clones of a model on different devices or
dtypes share one adapter safely; a cast may return the stored tensor itself, so nothing ever writes into a cast result.
"""

import math

import torch

# float64 is the only dtype wider than our default; anything narrower (fp16/bf16/fp8) is widened to fp32.
_WIDER_THAN_FP32 = (torch.float64,)


def compute_dtype(intermediate_dtype: torch.dtype | None = None) -> torch.dtype:
    """fp32, or the caller's intermediate dtype when it is wider (ComfyUI passes fp32, bf16 or fp16)."""
    if intermediate_dtype in _WIDER_THAN_FP32:
        return intermediate_dtype
    return torch.float32


def widens(weight_dtype: torch.dtype, intermediate_dtype: torch.dtype | None) -> bool:
    """Whether a result in the caller's intermediate dtype holds more than `weight_dtype`: true when that dtype is
    the compute dtype itself and `weight_dtype` is narrower (ComfyUI 0.33 patches an fp16 copy of W with an fp32
    intermediate). Returning the compute-dtype result then lets the caller round it once, instead of twice."""
    if intermediate_dtype is None or compute_dtype(intermediate_dtype) != intermediate_dtype:
        return False
    return weight_dtype.is_floating_point and torch.finfo(weight_dtype).bits < torch.finfo(intermediate_dtype).bits


def cast(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """`tensor` on `device` in `dtype`; a new tensor whenever anything changes (or `copy` is asked), the same one
    otherwise."""
    return tensor.to(device=device, dtype=dtype, copy=copy)


def cast_all(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
             keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor cast by `cast`, except those named in `keep`, which are passed on as stored."""
    return {name: t if name in keep else cast(t, device, dtype) for name, t in tensors.items()}


# A temporary made while patching a weight piece by piece is at most this large, and at most a quarter of the
# weight, so the two or three pieces alive at once never add up to one weight.
PIECE_BYTES = 16 * 2**20


def pieces(length: int, item_bytes: int) -> list[tuple[int, int]]:
    """(start, length) spans covering range(length), each at most PIECE_BYTES and a quarter of the whole (but at
    least one item)."""
    size = max(1, min(PIECE_BYTES // max(item_bytes, 1), -(-length // 4)))
    return [(start, min(size, length - start)) for start in range(0, length, size)]


def working_copy(weight: torch.Tensor, dtype: torch.dtype, private: bool = False) -> torch.Tensor:
    """What a patch computes in: `weight` itself when it is contiguous and already in `dtype` (and `private` is
    False), else a new contiguous copy in `dtype` — the one weight-sized temporary a patch may make."""
    if not private and weight.dtype == dtype and weight.is_contiguous():
        return weight
    return weight.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def add_scaled(out: torch.Tensor, tensor: torch.Tensor, alpha: float) -> None:
    """out += alpha · tensor, in place, for a `tensor` of out's shape in any dtype and on any device.

    When it is in out's dtype and on its device it is added directly. Otherwise it is cast piece by piece along
    dim 0, so no full-size converted copy exists at any time (torch's own mixed-dtype `add_` on CPU would make one).
    """
    if (tensor.dtype == out.dtype and tensor.device == out.device) or out.ndim == 0:
        out.add_(cast(tensor, out.device, out.dtype), alpha=alpha)
        return
    for start, length in pieces(out.shape[0], math.prod(out.shape[1:]) * out.element_size()):
        out.narrow(0, start, length).add_(cast(tensor.narrow(0, start, length), out.device, out.dtype), alpha=alpha)
