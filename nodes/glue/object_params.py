"""Parameters ComfyUI's weight patching never reaches, changed through object patches instead.

ComfyUI's `ModelPatcher.load` patches the parameters of leaf modules only (`_load_list` in 0.3.75 and 0.33 skips a
module whose children hold parameters: "random weights in non leaf modules"), so a patch on a block's own parameter
(Wan's `blocks.N.modulation` and `head.modulation`, LightX2V's `diff_m`) is accepted by `add_patches` and then never
applied, on a full load or offloaded. Such a change is computed once, when the node runs, as W' = W + s·ΔW from the
parameter this clone sees (an earlier file's change of it included) by the module's own adapter, and set with
`add_object_patch`: `patch_model` puts it in and `unpatch_model` takes it out again, for every way a model is loaded
(ComfyUI 0.38 applies its `.config` patches the same way). The parameter is small (6 × width per Wan block).
"""

import torch

# what a changed parameter carries: the parameter it replaced, for LyCORIS Save (the change is W' − W)
REPLACES = "lycoris_replaces"


def is_skipped_by_load(root: torch.nn.Module, key: str) -> bool:
    """A parameter whose module has children with parameters of their own: ComfyUI's loading never patches it."""
    owner = root.get_submodule(key.rsplit(".", 1)[0]) if "." in key else root
    own = {name for name, _ in owner.named_parameters(recurse=False)}
    return any(name not in own for name, _ in owner.named_parameters(recurse=True))


@torch.no_grad()
def changed_parameter(patcher, key: str, adapter, strength: float) -> torch.nn.Parameter:
    """The parameter `key` of this clone with `adapter`'s change at `strength`, rounded once into its dtype."""
    current = patcher.get_model_object(key)
    value = adapter.calculate_weight(current.detach().to(torch.float32, copy=True), key, strength, 1.0, None, None,
                                     torch.float32)
    changed = torch.nn.Parameter(value.to(current.dtype), requires_grad=False)
    setattr(changed, REPLACES, current)
    return changed
