"""Weights as the tools read them, without patching the model: W₀, the weight as loaded (before any patch, decoded
or dequantized, in the layout ComfyUI patches), and W', the weight as a patched MODEL/CLIP computes it: W₀, then
ComfyUI's own patch maths over `patcher.patches[key]` (comfy.lora.calculate_weight: our LycorisAdapter, ComfyUI's
LoRA adapters, anything a loader added), then the changes our bypassed files add in the forward (their injections'
`lycoris_entries`, in order): merged patches act first, then the bypass chain, as loading does."""

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import torch
from comfy.quant_ops import QuantizedTensor

from ...lycoris_core.bypass import changed_weight
from . import gguf
from .bypass import layer_name


def unpatched_weight(patcher, key: str) -> torch.Tensor:
    """The weight as loaded, before any patch, whatever is in the module now. ComfyUI patches the shared module in
    place and keeps the original in the patcher's `backup`, which clones share: the last loaded clone's patches
    stay in the module until another clone loads (dynamic loading's force-loaded weights too). Hooks patched on
    top keep the weight they replaced in `hook_backup`, the original unless a merged patch came first (then it is
    in `backup`). An offloaded weight is patched in its forward (LowVramPatch) and stored as loaded."""
    backup = patcher.backup.get(key)
    if backup is not None:
        return backup.weight
    hooked = patcher.hook_backup.get(key)
    if hooked is not None:
        return hooked[0]
    return comfy.model_patcher.get_key_weight(patcher.model, key)[0]


@torch.no_grad()
def base_weight(patcher, key: str, device: torch.device) -> torch.Tensor:
    """W₀ as ComfyUI patches it: a fresh fp32 copy on `device`, a packed GGUF weight decoded by the GGUF pack, a
    quantized one dequantized, through ComfyUI's converter function when the weight has one."""
    weight = unpatched_weight(patcher, key)  # no detach(): an inference tensor refuses it (no_grad suffices)
    _weight, _set, convert = comfy.model_patcher.get_key_weight(patcher.model, key)
    if gguf.is_packed(weight):
        weight = gguf.decoded(patcher.model.get_submodule(layer_name(key)), weight)
    elif isinstance(weight, QuantizedTensor):  # a new plain tensor (as_subclass on its copy fails in inference mode)
        weight = weight.dequantize()
    copy = comfy.model_management.cast_to_device(weight, device, torch.float32, copy=True)
    if gguf.is_gguf_tensor(copy):  # a GGUF F16 weight copies as its own class
        copy = copy.as_subclass(torch.Tensor)
    return convert(copy, inplace=True) if convert is not None else copy


@torch.no_grad()
def patched_weight(patcher, key: str, device: torch.device) -> torch.Tensor:
    """W' (fp32 on `device`, a fresh tensor) for a weight key of the patcher's model."""
    w = base_weight(patcher, key, device)
    if patcher.patches.get(key):
        w = comfy.lora.calculate_weight(patcher.patches[key], w, key, intermediate_dtype=torch.float32)
    bypassed = [contribution for entry_key, contribution in bypassed_entries(patcher) if entry_key == key]
    return changed_weight(w, bypassed) if bypassed else w


def bypassed_entries(patcher) -> list:
    """(weight key, Contribution) of every bypass injection of ours on the patcher, in the order they act."""
    return [entry for injections in patcher.injections.values() for injection in injections
            for entry in getattr(injection, "lycoris_entries", ())]
