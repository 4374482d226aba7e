"""Our patches as ComfyUI weight adapters, so every ComfyUI path that patches weights uses them unchanged:
full-load patching, LowVramPatch offload, hooks, merges and saving.

ComfyUI rebuilds adapters as `type(a)(a.loaded_keys, a.weights)` (dynamic VRAM prefetch), so everything an adapter
needs lives in `weights`: the immutable `Plan` first, then the tensors in `plan.names` order.
"""

import torch
from comfy.weight_adapter.base import WeightAdapterBase

from ...lycoris_core import LycorisError, Module, Plan, apply


class LycorisAdapter(WeightAdapterBase):
    name = "lycoris"

    def __init__(self, loaded_keys: set[str], weights: tuple):
        self.loaded_keys = loaded_keys
        self._weights = weights

    @property
    def weights(self) -> tuple:
        return self._weights

    @weights.setter
    def weights(self, weights: tuple) -> None:
        """The same plan and tensors of the same shapes (e.g. moved to another device), or an error: a loader that
        edits ComfyUI's own adapters in place (KJNodes' block LoRA loaders set `weights[2]` as the LoRA alpha) would
        otherwise break this patch only when it is computed, half-way through patching a model."""
        ours = self._weights
        same = (isinstance(weights, tuple) and len(weights) == len(ours) and weights[0] is ours[0]
                and all(isinstance(t, torch.Tensor) and t.shape == o.shape for t, o in zip(weights[1:], ours[1:])))
        if not same:
            raise LycorisError(
                "a loader changed this pack's patch in place, as it would change ComfyUI's own LoRA adapter (e.g. "
                "KJNodes' block LoRA loaders setting alpha per block); with 'Apply every LoRA loader's files with "
                "LyCORIS Nodes' on that loader cannot work: switch the setting off for it, or weight blocks with "
                "LyCORIS Block Weights", key=min(self.loaded_keys, default=None))
        self._weights = weights

    @classmethod
    def from_module(cls, module: Module, plan: Plan) -> "LycorisAdapter":
        keys = {f"{module.prefix}.{name}" for name in plan.names}
        return cls(keys, (plan, *(module.tensors[name] for name in plan.names)))

    @classmethod
    def load(cls, x, lora, alpha, dora_scale, loaded_keys=None):
        # Not in ComfyUI's probe list (comfy.weight_adapter.adapters): core LoRA loaders keep their own behaviour.
        return None

    @property
    def plan(self) -> Plan:
        return self.weights[0]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.plan.names, self.weights[1:]))

    def calculate_weight(self, weight, key, strength, strength_model, offset, function,
                         intermediate_dtype=torch.float32, original_weight=None):
        # `weight` always gets W' (rounded to its dtype). comfy.lora.calculate_weight takes our return value as the
        # weight and its caller rounds that into storage once, so when we are handed a narrower copy than the
        # intermediate dtype (0.33: an fp16 copy, fp32 intermediate) apply returns the unrounded fp32 W' instead.
        # With an offset ComfyUI drops the return value and keeps the parent copy, whose view holds the rounded W'.
        # LowVramPatch passes intermediate_dtype=weight.dtype: its forward gets the weight itself, in its dtype.
        return apply(self.plan, self.tensors, weight, strength, function, intermediate_dtype)

    def __repr__(self) -> str:
        return f"LycorisAdapter({self.plan.label}, {sorted(self.loaded_keys)[:1]}…)"
