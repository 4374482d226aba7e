"""The one place where patch tensors change device or dtype.

Patch tensors stay where and as they were loaded (usually CPU, file dtype). At the moment a patch is computed, each
tensor is cast to the patched weight's device and to the compute dtype; the maths runs there and the result is cast
once to the weight's dtype. Casting never mutates the stored tensor, so clones of a model on different devices or
dtypes share one adapter safely.
"""

import torch

# float64 is the only dtype wider than our default; anything narrower (fp16/bf16/fp8) is widened to fp32.
_WIDER_THAN_FP32 = (torch.float64,)


def compute_dtype(intermediate_dtype: torch.dtype | None = None) -> torch.dtype:
    """fp32, or the caller's intermediate dtype when it is wider (ComfyUI passes fp32, bf16 or fp16)."""
    if intermediate_dtype in _WIDER_THAN_FP32:
        return intermediate_dtype
    return torch.float32


def cast(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`; a new tensor whenever anything changes, the same one otherwise."""
    return tensor.to(device=device, dtype=dtype)


def cast_all(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: cast(t, device, dtype) for name, t in tensors.items()}
