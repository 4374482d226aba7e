"""Weights of layers loaded by the ComfyUI-GGUF pack (city96), recognised by duck typing.

That pack is optional and ComfyUI imports it under a module name made from its folder path, so it cannot be
imported by a fixed name: its tensors are recognised by what they carry instead. A `GGMLTensor` holds the file's
blocks as stored (`.data`, packed bytes for quantized types) with the GGML type in `tensor_type` and the logical
shape in `tensor_shape`; its layers (`GGMLLayer`) decode it in `get_weight` and say whether it is quantized in
`is_ggml_quantized`. Whatever must be decoded is decoded by the pack's own code, never by ours.
"""

import sys

import torch


def is_gguf_tensor(tensor) -> bool:
    """A GGMLTensor: a tensor carrying its GGML type and logical shape."""
    return isinstance(tensor, torch.Tensor) and hasattr(tensor, "tensor_type") and hasattr(tensor, "tensor_shape")


def is_gguf_layer(layer) -> bool:
    """A layer of the pack's GGMLOps holding a GGMLTensor weight."""
    return (callable(getattr(layer, "get_weight", None)) and callable(getattr(layer, "is_ggml_quantized", None))
            and is_gguf_tensor(getattr(layer, "weight", None)))


def is_packed(tensor) -> bool:
    """A GGMLTensor stored as quantized blocks (Q8_0, Q4_K, BF16…), which only the pack's decoder can read; the
    pack keeps F16/F32 tensors as plain float data (its `is_quantized` is False for those)."""
    return is_gguf_tensor(tensor) and not tensor.is_floating_point()


def logical_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The weight's shape as the model uses it (a packed GGMLTensor's storage shape is that of its blocks)."""
    return tuple(tensor.tensor_shape) if is_gguf_tensor(tensor) else tuple(tensor.shape)


def type_name(tensor) -> str:
    """The GGML type's name, e.g. "Q4_0"."""
    return getattr(tensor.tensor_type, "name", str(tensor.tensor_type))


def read_weight(layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's weight and bias as its forward sees them, through the pack's own cast: decoded, with the patches
    the pack's GGUFModelPatcher attached (files merged before ours) applied; fp32 on `device`, plain tensors."""
    weight, bias = layer.cast_bias_weight(dtype=torch.float32, device=device)
    return weight.as_subclass(torch.Tensor), None if bias is None else bias.as_subclass(torch.Tensor)


def decoded(layer: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (one of `layer`'s GGMLTensors) decoded to fp32 by the pack's `dequantize_tensor`, found in the
    module that defines the layer's class (ops.py imports it), ignoring any patches attached to it."""
    dequantize = sys.modules[type(layer).__module__].dequantize_tensor
    return dequantize(tensor, torch.float32, getattr(layer, "dequant_dtype", None)).as_subclass(torch.Tensor)
