"""What a layer and its weight are, for merging and bypassing, and the weight read as its forward runs it.

Classification: a layer's op (`layer_op`: Linear-like or ConvNd, by structure), whether ComfyUI runs it without its
forward (`skips_forward`), and how a parameter is stored (`weight_format`: plain float, fp8, ComfyUI's quantized
layouts, GGUF, or a tensor type we cannot read) with what that means for a merge. Reading: `float_weight` /
`float_weight_and_bias`, the weight and bias as fp32 on a device, through ComfyUI's (or the GGUF pack's) cast path.
The decision itself is `routing.route`, a function of these facts.
"""

from dataclasses import dataclass

import comfy.model_management
import comfy.ops
import torch
from comfy.quant_ops import QuantizedTensor

from ...lycoris_core.bypass import LayerOp
from ...lycoris_core.casting import cast
from . import gguf

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Where bypass.py keeps a layer's BypassLayer, also while no entry is on it: a read hides its cast guards, so it
# gets W as the layer's own forward gets it.
BYPASS_HOLDER = "_lycoris_bypass_kept"


def layer_op(layer: torch.nn.Module) -> LayerOp | None:
    """The bias-free op of a Linear-like or ConvNd layer (by structure, so ComfyUI's cast, fp8 and quantized
    layer classes count), or None for anything else (norms, embeddings, circular padding)."""
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        if layer.padding_mode != "zeros" or layer.transposed:
            return None
        # kernel_size, not weight.ndim: a GGUF weight's storage is its packed blocks
        return LayerOp(len(layer.kernel_size), tuple(layer.stride), layer.padding, tuple(layer.dilation),
                       layer.groups)
    if hasattr(layer, "in_features") and hasattr(layer, "out_features") and not isinstance(layer, torch.nn.Embedding):
        return LayerOp()
    return None


def _data(weight: torch.Tensor) -> torch.Tensor:
    return weight.data if isinstance(weight, torch.nn.Parameter) else weight


def is_plain_float(weight: torch.Tensor) -> bool:
    """A weight a merge can patch without loss beyond its dtype's rounding: an ordinary fp32/fp16/bf16/fp64 tensor,
    or a GGUF F16/F32 one (plain float data; the GGUF pack merges it like any fp16 weight)."""
    if gguf.is_gguf_tensor(weight):  # before `.data`, which drops the GGUF attributes
        return not gguf.is_packed(weight) and weight.dtype in FLOAT_DTYPES
    data = _data(weight)
    return type(data) is torch.Tensor and data.dtype in FLOAT_DTYPES


def merge_is_exact(weight: torch.Tensor) -> bool:
    """A merge patches this weight without loss beyond its dtype's rounding: plain float, or any GGUF weight (the
    GGUF pack applies merged patches to the decoded weight at every forward and never re-quantizes; measured no
    slower than bypass for LoRA and faster for changes that read W, bench/results-quantized-*.md)."""
    return is_plain_float(weight) or gguf.is_gguf_tensor(weight)


def is_readable(weight: torch.Tensor) -> bool:
    """A weight `float_weight` can read: an ordinary tensor of any float dtype (fp8 included), ComfyUI's
    QuantizedTensor, or a GGUF weight (decoded by the GGUF pack's own cast)."""
    if gguf.is_gguf_tensor(weight):
        return True
    data = _data(weight)
    return isinstance(data, QuantizedTensor) or (type(data) is torch.Tensor and data.is_floating_point())


# ComfyUI's QuantizedTensor layouts whose name says more than their stored dtype (0.33 `_layout_cls`)
_LAYOUT_FORMATS = {"TensorCoreMXFP8Layout": "mxfp8", "TensorCoreNVFP4Layout": "nvfp4", "TensorWiseINT8Layout": "int8"}


def _dtype_format(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float8_", "fp8 ")


def storage_format(weight: torch.Tensor) -> str | None:
    """How a weight is stored when that is not plain float ("GGUF Q4_0", "fp8 e4m3fn", "int8", "mxfp8"), else None
    (fp32/fp16/bf16, GGUF F16/F32)."""
    if gguf.is_gguf_tensor(weight):
        return f"GGUF {gguf.type_name(weight)}" if gguf.is_packed(weight) else None
    data = _data(weight)
    if isinstance(data, QuantizedTensor):
        layout = getattr(data, "_layout_cls", None) or getattr(data, "_layout_type", None)  # 0.33 / 0.3.75
        name = layout if isinstance(layout, str) else getattr(layout, "__name__", "")
        return _LAYOUT_FORMATS.get(name) or _dtype_format(data._qdata.dtype)
    return None if data.dtype in FLOAT_DTYPES else _dtype_format(data.dtype)


def merge_rounds(weight: torch.Tensor) -> str | None:
    """The storage format a merge re-rounds W+ΔW into (fp8, ComfyUI's quantized layouts), else None. A packed GGUF
    weight is not: the GGUF pack applies merged patches to the decoded weight at every forward."""
    fmt = storage_format(weight)
    return None if fmt is None or gguf.is_gguf_tensor(weight) else fmt


def merge_dtype(patcher) -> torch.dtype | None:
    """The dtype ComfyUI patches a fully loaded weight in (0.33's `lora_compute_dtype`: fp16 on most NVIDIA GPUs),
    or None (0.3.75 patches an fp32 copy)."""
    dtype_of = getattr(comfy.model_management, "lora_compute_dtype", None)
    return dtype_of(patcher.load_device) if dtype_of is not None else None


def merge_narrows(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """ComfyUI would merge into this plain float tensor through a narrower copy (0.33 rounds an fp32 W to fp16
    before any adapter runs), so the merge is off by that rounding. GGUF tensors are patched by the GGUF pack."""
    return weight_format(tensor).merged_narrower(dtype)


def narrowed_format(tensor: torch.Tensor, dtype: torch.dtype | None) -> str | None:
    """What the report says of a plain float tensor bypassed because ComfyUI would merge it narrower."""
    if not merge_narrows(tensor, dtype):
        return None
    return f"{_dtype_format(_data(tensor).dtype)} merged by ComfyUI in {_dtype_format(dtype)}"


def is_comfy_op(layer: torch.nn.Module) -> bool:
    """A comfy.ops layer: where its weight is and what is applied to it on the way to the forward (merged patches
    of an offloaded or dynamically loaded layer, dequantisation) is up to ComfyUI's cast path."""
    return hasattr(layer, "comfy_cast_weights")


def skips_forward(layer: torch.nn.Module) -> bool:
    """An INT8 tensorwise layer, which ComfyUI 0.33's `comfy.ops.linear_input_act` (Wan/LTX feed-forward down
    projections, MiniMax, Llama-type text encoders) multiplies by its weight itself, never calling its forward
    (the same test as there; 0.3.75 has no such layout)."""
    weight = getattr(layer, "weight", None)
    return (isinstance(weight, QuantizedTensor) and getattr(weight, "_layout_cls", None) == "TensorWiseINT8Layout"
            and not getattr(getattr(weight, "_params", None), "transposed", False))


def _read_dtype(layer: torch.nn.Module, device: torch.device) -> torch.dtype:
    """fp32, or fp64 for an fp32 weight (its dynamic-VRAM geometry dtype, `_model_dtype`, where set) that reaches
    `device` through one of ComfyUI's transfer buffers (dynamic VRAM, or an offloaded layer). In a dtype other than
    the stored one the cast hands back a new tensor: the merged patches run on that copy, never in place on a buffer
    the layer's own cast reads next, and the read is no view of a buffer ComfyUI reuses."""
    weight = layer.weight
    if isinstance(weight, QuantizedTensor):
        return torch.float32  # dequantising always makes a new tensor
    through_buffer = hasattr(layer, "_v") or weight.device != device
    stored = getattr(weight, "_model_dtype", weight.dtype)
    return torch.float64 if through_buffer and stored == torch.float32 else torch.float32


def float_weight(layer: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The layer's weight as fp32 on `device`, as its forward runs it (`float_weight_and_bias`)."""
    return float_weight_and_bias(layer, device)[0]


def float_weight_and_bias(layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's weight and bias as fp32 on `device`, as its forward runs them: with the patches merged before
    this adapter (in the weight, in a LowVramPatch of an offloaded layer, or applied on the fly under dynamic VRAM),
    dequantized (QuantizedTensor) or unscaled (scaled fp8). A comfy.ops layer is read through ComfyUI's own cast
    path; new tensors, so they are released at once and hold nothing of ComfyUI's while the layer's forward runs.
    A packed GGUF weight is read through the GGUF pack's own cast, which decodes it and applies the patches its
    GGUFModelPatcher attached to it."""
    if gguf.is_gguf_layer(layer) and gguf.is_packed(layer.weight):
        weight, bias = gguf.read_weight(layer, device)
        return cast(weight, device, torch.float32), _float(bias, device)
    if not is_comfy_op(layer):
        return _own_float(layer, "weight", device), _own_float(layer, "bias", device)
    dtype = _read_dtype(layer, device)
    holder = layer.__dict__.get(BYPASS_HOLDER)  # its cast guards stay out of this read: it wants W as the forward gets it
    lists = holder.hide_guards() if holder is not None else {}
    try:
        weight, bias, offload = comfy.ops.cast_bias_weight(layer, dtype=dtype, device=device, bias_dtype=dtype,
                                                           offloadable=True)
    finally:
        if holder is not None:
            holder.restore(lists)
    try:
        read = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        convert = getattr(layer, "convert_weight", None)  # 0.3.75's scaled fp8: the cast gives W / scale_weight
        if convert is not None:
            read = convert(read, inplace=False)
        read = cast(read, device, torch.float32)
        read = read.as_subclass(torch.Tensor) if gguf.is_gguf_tensor(read) else read  # GGUF F16 reads as its class
        return read, _float(bias, device, copy=True)
    finally:
        comfy.ops.uncast_bias_weight(layer, weight, bias, offload)


def _float(tensor: torch.Tensor | None, device: torch.device, copy: bool = False) -> torch.Tensor | None:
    """fp32 on `device`, a plain tensor (a copy when asked: a cast's result may be a buffer ComfyUI reuses)."""
    if tensor is None:
        return None
    tensor = tensor.as_subclass(torch.Tensor) if gguf.is_gguf_tensor(tensor) else tensor
    return cast(tensor, device, torch.float32, copy=copy)


def _own_float(layer: torch.nn.Module, name: str, device: torch.device) -> torch.Tensor | None:
    """A plain torch layer's weight or bias as fp32 on `device`, with any per-forward functions applied."""
    value = getattr(layer, name, None)
    if value is None:
        return None
    if isinstance(value, QuantizedTensor):
        value = value.dequantize()
    functions = getattr(layer, f"{name}_function", None)
    if functions:  # as comfy.ops.cast_bias_weight: on a copy, the functions may work in place
        value = cast(value, device, torch.float32, copy=True)
        for function in functions:
            value = function(value)
        if isinstance(value, QuantizedTensor):
            value = value.dequantize()
    convert = getattr(layer, f"convert_{name}", None)
    if convert is not None:
        value = convert(value, inplace=False)
    return cast(value, device, torch.float32)



@dataclass(frozen=True)
class WeightFormat:
    """What a merge and a bypass can do with one stored parameter (`weight_format`), as plain values."""

    name: str | None  # how it is stored when not plain float (`storage_format`: "fp8 e4m3fn", "int8", "GGUF Q4_0")
    readable: bool  # `float_weight` can read it (a change that reads W can then run in the forward)
    merge_exact: bool  # a merge patches it with no loss beyond its dtype's rounding (plain float, any GGUF)
    merge_rounds: bool  # a merge re-rounds W + dW into its stored format (fp8, ComfyUI's quantized layouts)
    merged_copy: torch.dtype | None  # a plain float (not GGUF) tensor's dtype: ComfyUI merges through a copy of it

    def merged_narrower(self, compute_dtype: torch.dtype | None) -> bool:
        """ComfyUI would merge into it through a copy in `compute_dtype` (`merge_dtype`) narrower than its own."""
        return (compute_dtype is not None and self.merged_copy is not None
                and compute_dtype.itemsize < self.merged_copy.itemsize)


def weight_format(tensor: torch.Tensor) -> WeightFormat:
    """The stored parameter's format, for routing."""
    plain = is_plain_float(tensor) and not gguf.is_gguf_tensor(tensor)
    return WeightFormat(storage_format(tensor), is_readable(tensor), merge_is_exact(tensor),
                        merge_rounds(tensor) is not None, _data(tensor).dtype if plain else None)
