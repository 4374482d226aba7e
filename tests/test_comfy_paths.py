"""Our adapters through the ComfyUI paths other than plain loading: hooks (scheduled LoRA) and the
get_key_patches → calculate_weight route that model merging and saving use.

Truth is the LoRA formula written here in float64, W + m·(alpha/r)·up@down, not our own code.
"""

import comfy.hooks
import comfy.lora
import comfy.model_patcher
import comfy.ops
import torch
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.glue.apply import build_patches

CPU = torch.device("cpu")


class OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = comfy.ops.manual_cast.Linear(6, 8)


def _setup(seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = OneLinear()
    model.lin.weight.data = torch.randn(8, 6, generator=gen)
    model.lin.bias.data = torch.zeros(8)
    sd = {"lin.lora_up.weight": torch.randn(8, 4, generator=gen), "lin.lora_down.weight": torch.randn(4, 6, generator=gen),
          "lin.alpha": torch.tensor(2.0)}
    patches, report = build_patches(parse_state_dict(sd), {"lin": "lin.weight"}, {"model": {"lin.weight": (8, 6)}},
                                    reference=False)
    assert len(report.applied) == 1
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    return model, sd, patches["model"], patcher


def _expected(w0, sd, m):
    delta = sd["lin.lora_up.weight"].double() @ sd["lin.lora_down.weight"].double() * (2.0 / 4)
    return (w0.double() + m * delta).float()


def test_weight_hook_applies_and_unhooks_exactly():
    model, sd, patches, patcher = _setup()
    w0 = model.lin.weight.detach().clone()
    hook = comfy.hooks.WeightHook(strength_model=0.5)
    hook.weights, hook.need_weight_init = patches, False  # pre-built patches: our adapters, not comfy's probe
    group = comfy.hooks.HookGroup()
    group.add(hook)
    patcher.register_all_hook_patches(group, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
    patcher.patch_model(device_to=CPU)
    patcher.apply_hooks(group)
    torch.testing.assert_close(model.lin.weight.detach(), _expected(w0, sd, 0.5), rtol=0, atol=1e-5)
    patcher.unpatch_hooks()
    assert torch.equal(model.lin.weight, w0)


def test_key_patches_route_used_by_merging_and_saving():
    model, sd, patches, patcher = _setup(seed=1)
    w0 = model.lin.weight.detach().clone()
    patcher.add_patches(patches, 0.75)
    key_patches = patcher.get_key_patches()["lin.weight"]
    original, convert = key_patches[0]
    merged = comfy.lora.calculate_weight(key_patches[1:], convert(original.clone().float(), inplace=True), "lin.weight")
    torch.testing.assert_close(merged, _expected(w0, sd, 0.75), rtol=0, atol=1e-5)
    assert torch.equal(model.lin.weight, w0), "computing a merge must not touch the model's own weight"
