"""A weight as a patched MODEL/CLIP computes it, without patching the model: the stored weight (the patcher's backup
copy when ComfyUI has the model loaded with patches applied in place), then ComfyUI's own patch maths over
`patcher.patches[key]` (comfy.lora.calculate_weight: our LycorisAdapter, ComfyUI's LoRA adapters, anything a loader
added), then the changes our bypassed files add in the forward (their injections' `lycoris_entries`, in order):
merged patches act first, then the bypass chain, as loading does."""

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import torch


def stored_weight(patcher, key: str) -> torch.Tensor:
    """The weight as loaded, before any patch. Clones share `backup`, so another clone's patches applied in place
    are never mistaken for this one's."""
    backup = patcher.backup.get(key)
    if backup is not None:
        return backup.weight
    weight, _set, _convert = comfy.model_patcher.get_key_weight(patcher.model, key)
    return weight


@torch.no_grad()
def patched_weight(patcher, key: str, device: torch.device) -> torch.Tensor:
    """W' (fp32 on `device`, a fresh tensor) for a weight key of the patcher's model."""
    _weight, _set, convert = comfy.model_patcher.get_key_weight(patcher.model, key)
    w = comfy.model_management.cast_to_device(stored_weight(patcher, key), device, torch.float32, copy=True)
    if convert is not None:
        w = convert(w, inplace=True)
    if patcher.patches.get(key):
        w = comfy.lora.calculate_weight(patcher.patches[key], w, key)
    for entry_key, contribution in bypassed_entries(patcher):
        if entry_key == key:
            contribution.rows_of(w).add_(contribution.change(w))
    return w


def bypassed_entries(patcher) -> list:
    """(weight key, Contribution) of every bypass injection of ours on the patcher, in the order they act."""
    return [entry for injections in patcher.injections.values() for injection in injections
            for entry in getattr(injection, "lycoris_entries", ())]
