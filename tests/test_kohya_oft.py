"""kohya sd-scripts' own OFT (`networks.oft`, `oft_unet_…` modules), applied as sd-scripts defines it.

sd-scripts is not on the package registry, so the truth here is an independent float64 rendering of what its
`networks/oft.py` (kohya-ss/sd-scripts, read at 077f6a4) does, on tensors shaped and named as its `save_weights`
writes them (`oft_unet_<diffusers module path with _>.oft_blocks` (num_blocks, b, b), `.alpha` 0-d):

    Q = B − Bᵀ;  Q ← Q · (min(‖Q‖_F, C) + 1e-8) / (‖Q‖_F + 1e-8),  C = alpha · out   (one norm over all blocks)
    R = (I + Q)(I − Q)⁻¹;  R_m = I + m(R − I)                                          (m: sd-scripts' multiplier)
    W' rows of block k = R_mᵀ W_k  (Linear: W (out, in); Conv2d: (out, in, kh, kw), rows only)

Strength: the node's strength is sd-scripts' multiplier m in both strength modes: "lycoris" forms I + m(R − I) as
sd-scripts does, and "linear" W + m·(W'(1) − W) is the same thing, as kohya's OFT has no rescale.
"""

import comfy.model_management
import comfy.supported_models as supported
import pytest
import test_nodes
import torch
import torch.nn.functional as F
from lycoris_nodes.lycoris_core import LycorisError, parse_state_dict
from lycoris_nodes.lycoris_core.bypass import Contribution, LayerOp, layer_output
from lycoris_nodes.lycoris_core.patch import apply
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.glue.apply import build_patches, map_file
from lycoris_nodes.nodes.glue.keymap import lora_key_map, model_shapes
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from node_runner import execute
from test_nodes import weights_after_full_load, write
from test_trainer_names import SDXL_CONFIG, SDXL_TO_Q

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15, loras = test_nodes.sd15, test_nodes.loras  # fixtures

# module (as sd-scripts names it: diffusers path, dots → "_") -> the ComfyUI weight it patches
TO_Q = "oft_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"  # Linear 320→320
FF_OUT = "oft_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_2"  # Linear 1280→320 (enable_all_linear)
PROJ_IN = "oft_unet_down_blocks_0_attentions_0_proj_in"  # Conv2d 1×1 320→320
CONV3 = "oft_unet_down_blocks_0_resnets_0_conv1"  # Conv2d 3×3 320→320 (enable_conv)
TARGETS = {
    TO_Q: "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
    FF_OUT: "diffusion_model.input_blocks.1.1.transformer_blocks.0.ff.net.2.weight",
    PROJ_IN: "diffusion_model.input_blocks.1.1.proj_in.weight",
    CONV3: "diffusion_model.input_blocks.1.0.in_layers.2.weight",
}
NUM_BLOCKS = 4  # sd-scripts' network_dim: the number of blocks
BINDING, LOOSE = 1e-3, 0.1  # alpha: C = alpha·320 = 0.32 < ‖Q‖ ≈ 2.3 (the clamp acts), 32 > ‖Q‖ (it does not)
RTOL = 2e-6  # fp32 maths on fp32 weights; every file changes its weights by > 1e-2 of their norm


def kohya_file(alpha: float, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A state dict as sd-scripts' OFTNetwork.save_weights writes it: every entry, alpha included, in the save
    precision `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for prefix in TARGETS:
        b = 320 // NUM_BLOCKS
        sd[f"{prefix}.oft_blocks"] = (torch.randn(NUM_BLOCKS, b, b, generator=gen) * 0.01).to(dtype)
        sd[f"{prefix}.alpha"] = torch.tensor(alpha).to(dtype)
    return sd


# --- truth: sd-scripts' forward, in float64 ---------------------------------------------------------------------

def kohya_rotation(blocks: torch.Tensor, alpha: float, m: float) -> torch.Tensor:
    b = blocks.double()
    constraint = alpha * b.shape[0] * b.shape[1]  # alpha · out_dim
    q = b - b.transpose(1, 2)
    norm = float(q.flatten().norm())
    q = q * ((min(norm, constraint) + 1e-8) / (norm + 1e-8))
    eye = torch.eye(b.shape[1], dtype=torch.float64).repeat(b.shape[0], 1, 1)
    r = (eye + q) @ torch.linalg.inv(eye - q)
    return m * (r - eye) + eye


def kohya_weight(weight: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    k, n = rotation.shape[0], rotation.shape[1]
    rows = weight.double().reshape(k, n, *weight.shape[1:])
    return torch.einsum("knm,kn...->km...", rotation, rows).reshape(weight.shape)


def truth_weight(sd, prefix, weight, m):
    return kohya_weight(weight, kohya_rotation(sd[f"{prefix}.oft_blocks"], float(sd[f"{prefix}.alpha"]), m))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(autouse=True)
def no_panel_measurement(monkeypatch):
    monkeypatch.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)


# --- the file is read as kohya's OFT and reaches the model -----------------------------------------------------

def test_every_module_maps_to_its_weight(sd15, loras):
    write(loras, "kohya_oft.safetensors", kohya_file(BINDING), {"ss_network_module": "networks.oft"})
    lfile = cache.load_cached(str(loras / "kohya_oft.safetensors"))
    assert {m.algorithm.name for m in lfile.modules.values()} == {"kohya-oft"}
    _patches, report = map_file(lfile, sd15[0], None, reference=True)
    assert report.problems == [] and report.unused_keys == []
    assert {k.split(".")[0]: v for k, v in report.applied.items()} == \
        {p.replace("oft_unet_", "lora_unet_"): t for p, t in TARGETS.items()}
    assert dict(report.labels) == {"OFT (kohya)": 4}


# --- merge through the node, strengths 1, 0.5, −1 ----------------------------------------------------------------

@pytest.mark.parametrize("alpha", [BINDING, LOOSE])
@pytest.mark.parametrize("strength", [1.0, 0.5, -1.0])
def test_merge_equals_sd_scripts(sd15, loras, alpha, strength):
    """strength_mode "lycoris": the node's strength is sd-scripts' multiplier."""
    model = sd15[0]
    sd = kohya_file(alpha)
    name = write(loras, "kohya_oft.safetensors", sd)
    patched = execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=strength,
                      strength_mode="lycoris", apply_mode="merge").result[0]
    base = model.model.state_dict()
    got = weights_after_full_load(patched, list(TARGETS.values()))
    for prefix, key in TARGETS.items():
        truth = truth_weight(sd, prefix, base[key], strength)
        assert rel(truth, base[key]) > 1e-2, f"{prefix}: the file barely changes the weight"
        assert rel(got[key], truth) < RTOL, f"{prefix}: {rel(got[key], truth):.2e} from sd-scripts' merge"


def test_linear_strength_mode_is_sd_scripts_multiplier_too(sd15, loras):
    """Without a rescale, W + m·(RᵀW − W) = (I + m(R − I))ᵀW: both strength modes are sd-scripts' multiplier."""
    assert_merged_like_sd_scripts(sd15[0], loras, kohya_file(BINDING), 0.5, "linear")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_of_a_half_precision_file_uses_the_stored_values(sd15, loras, dtype):
    """save_precision fp16/bf16 rounds alpha too (sd-scripts casts the whole state dict): the constraint is the
    stored alpha · out, as sd-scripts reads it back (param.item())."""
    assert_merged_like_sd_scripts(sd15[0], loras, kohya_file(BINDING, dtype=dtype), 1.0, "lycoris")


def assert_merged_like_sd_scripts(model, loras, sd, strength, strength_mode):
    """The file merged by the loader node at `strength` equals sd-scripts' forward, weight by weight."""
    name = write(loras, "kohya_oft.safetensors", sd)
    patched = execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=strength,
                      strength_mode=strength_mode, apply_mode="merge").result[0]
    base = model.model.state_dict()
    got = weights_after_full_load(patched, list(TARGETS.values()))
    for prefix, key in TARGETS.items():
        assert rel(got[key], truth_weight(sd, prefix, base[key], strength)) < RTOL


def test_sdxl_names_map():
    """sd-scripts trains SDXL in its original U-Net names: oft_unet_input_blocks_4_1_…, on ComfyUI's SDXL."""
    model = supported.SDXL(dict(SDXL_CONFIG)).get_model({}, "", device="meta")
    prefix = "oft_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    sd = {f"{prefix}.oft_blocks": torch.zeros(NUM_BLOCKS, 160, 160), f"{prefix}.alpha": torch.tensor(BINDING)}
    report = build_patches(parse_state_dict(sd, "sdxl_oft.safetensors"), lora_key_map(model, is_clip=False),
                           {"model": model_shapes(model)}, False)[1]
    assert report.problems == []
    assert report.applied == {prefix.replace("oft_", "lora_", 1) + ".weight": SDXL_TO_Q}


# --- bypass: the layer's forward, against sd-scripts' forward ----------------------------------------------------

@pytest.mark.parametrize("strength", [1.0, 0.5, -1.0])
@pytest.mark.parametrize("prefix,op,x_shape", [
    (TO_Q, LayerOp(), (2, 7, 320)),
    (FF_OUT, LayerOp(), (2, 7, 1280)),
    (PROJ_IN, LayerOp(2), (1, 320, 6, 6)),
    (CONV3, LayerOp(2, padding=(1, 1)), (1, 320, 6, 6)),
])
def test_bypass_forward_equals_sd_scripts_forward(sd15, prefix, op, x_shape, strength):
    sd = kohya_file(BINDING)
    module = parse_state_dict(sd, "kohya_oft.safetensors").modules[prefix.replace("oft_", "lora_", 1) + ".weight"]
    weight = sd15[0].model.state_dict()[TARGETS[prefix]].float()
    plan = module.plan_for(tuple(weight.shape), reference=True)
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(1))
    y = op(x, weight)
    got = layer_output(x, lambda xi: op(xi, weight), op, [Contribution(plan, module.tensors, strength)], weight)
    rw = truth_weight(sd, prefix, weight, strength)
    truth = F.linear(x.double(), rw) if not op.conv_dims else F.conv2d(x.double(), rw, None, 1, op.padding)
    assert rel(truth, y) > 1e-2
    assert rel(got, truth) < 1e-5, f"{rel(got, truth):.2e} from sd-scripts' forward"


def test_bypass_node_samples_as_the_merge(sd15, loras):
    model = sd15[0]
    name = write(loras, "kohya_oft.safetensors", kohya_file(BINDING))
    common = {"model": model, "lycoris_name": name, "strength_model": 0.5, "strength_mode": "lycoris"}
    merged = execute(LycorisLoaderModelOnly, apply_mode="merge", **common).result[0]
    bypassed = execute(LycorisLoaderModelOnly, apply_mode="bypass", **common).result[0]
    gen = torch.Generator().manual_seed(0)
    conds = ([[torch.randn(1, 77, 768, generator=gen) * 0.5, {}]], [[torch.zeros(1, 77, 768), {}]])
    latent = comfy_nodes.EmptyLatentImage().generate(64, 64, 1)[0]

    def sample(m):
        with torch.inference_mode():
            return comfy_nodes.common_ksampler(m, 0, 1, 1.0, "euler", "normal", *conds, latent)[0]["samples"]

    base, a, b = sample(model), sample(merged), sample(bypassed)
    comfy.model_management.unload_all_models()
    assert rel(a, base) > 1e-3
    assert rel(b, a) < 1e-5


# --- where sd-scripts and LyCORIS' diag-OFT differ ---------------------------------------------------------------

def test_alpha_zero_is_no_change_as_in_sd_scripts_not_unconstrained_as_in_lycoris(sd15):
    """sd-scripts clamps ‖Q‖ to C = 0 (R = I up to 1e-8); LyCORIS' diag-OFT reads constraint 0 as 'none'."""
    sd = kohya_file(0.0)
    kohya = parse_state_dict(sd, "kohya").modules[TO_Q.replace("oft_", "lora_", 1) + ".weight"]
    lycoris = parse_state_dict({k.replace("oft_unet_", "lycoris_"): v for k, v in sd.items()}, "lycoris").modules[
        TO_Q.replace("oft_unet_", "lycoris_") + ".weight"]
    assert lycoris.algorithm.name == "diag-oft"
    weight = sd15[0].model.state_dict()[TARGETS[TO_Q]].float()
    got = {name: apply(m.plan_for(tuple(weight.shape), reference=True), m.tensors, weight.clone(), 1.0)
           for name, m in (("kohya", kohya), ("lycoris", lycoris))}
    assert rel(got["kohya"], weight) < 1e-6  # sd-scripts: no change
    assert rel(got["kohya"], truth_weight(sd, TO_Q, weight, 1.0)) < 1e-6
    assert rel(got["lycoris"], weight) > 1e-2  # LyCORIS' reading rotates by the unconstrained blocks


def test_a_file_without_alpha_is_refused_naming_the_key():
    """sd-scripts cannot load one either (its constraint would be None · out_dim)."""
    sd = {k: v for k, v in kohya_file(BINDING).items() if not k.endswith(".alpha")}
    with pytest.raises(LycorisError, match="alpha"):
        parse_state_dict(sd, "no_alpha.safetensors")
