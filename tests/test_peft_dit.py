"""PEFT / diffusers adapter files on a DiT whose names differ from ComfyUI's: a tiny Flux (issue #10).

A tiny diffusers `FluxTransformer2DModel` is converted by ComfyUI's own diffusers loader step
(`comfy.model_detection.convert_diffusers_mmdit`, built on `comfy.utils.flux_to_diffusers`) into ComfyUI's Flux
(one forward of each checks the conversion). There to_q/to_k/to_v (and add_*_proj, and a single block's proj_mlp)
are row slices of ComfyUI's fused `qkv` / `linear1`, and `norm_out.linear` is stored with its two halves swapped.

PEFT attaches every adapter type it can save (LoRA, LoRA with rank/alpha patterns, DoRA, LoHa, LoKr, OFT, BOFT,
(IA)³) to the attention projections, the feed-forward layers and the single blocks' projections; the files are
written by diffusers' `FluxPipeline.save_lora_weights` (with and without `lora_adapter_metadata`) and PEFT's
`save_pretrained`, loaded through our loader node, and compared with PEFT's own `merge()` of each layer (float64),
mapped onto ComfyUI's weights and row slices by ComfyUI's converter: fp32 error ≤ 1e-4 of the change, at strengths
1 and 0.5.

OFT, BOFT, DoRA and (IA)³ read the weight row by row (the rotation acts on the inputs, the scale/norm/magnitude is
per output row), so a row slice of qkv is exactly to_q's weight and they apply exactly there too (ComfyUI hands the
adapter the narrowed view). norm_out.linear's rows are ComfyUI's with the halves swapped (ComfyUI's map gives it
with the converter function swap_scale_shift): each half is applied as a module of its own onto the other half of
ComfyUI's rows, exact for every adapter with a split by rows (DoRA and (IA)³ included); OFT and BOFT have none in
the pack and are refused there by name (last test).
"""

import copy
import dataclasses

import comfy.model_base
import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import comfy.utils
import peft
import pytest
import test_nodes
import torch
from comfy.ldm.flux.model import FluxParams
from diffusers import FluxPipeline, FluxTransformer2DModel
from einops import rearrange
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from peft.tuners.boft import layer as boft_layer
from peft.tuners.tuners_utils import BaseTunerLayer
from test_nodes import run_node, weights_after_full_load
from test_peft_formats import FakeBlockDiagKernel

loras = test_nodes.loras
CPU = torch.device("cpu")
HIDDEN, HEADS, MLP = 32, 2, 128
DIFFUSERS_CONFIG = {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 2,
                    "attention_head_dim": HIDDEN // HEADS, "num_attention_heads": HEADS, "joint_attention_dim": 24,
                    "pooled_projection_dim": 20, "guidance_embeds": True, "axes_dims_rope": (4, 6, 6)}
# ComfyUI's Flux config for the same model (its detection hard-codes full Flux's heads and rope axes).
COMFY_CONFIG = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 20,
                "context_in_dim": 24, "hidden_size": HIDDEN, "mlp_ratio": MLP / HIDDEN, "num_heads": HEADS,
                "depth": 2, "depth_single_blocks": 2, "axes_dim": [4, 6, 6], "theta": 10000, "qkv_bias": True,
                "guidance_embed": True}
if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
    COMFY_CONFIG["txt_ids_dims"] = []  # 0.33's Flux also takes the text position-id layout; 0.3.75's has none

# Attention projections (fused into qkv / linear1 by ComfyUI), feed-forward, single-block proj_mlp (a row slice of
# linear1) and proj_out (single blocks' linear2 and the final layer's linear).
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
# final_layer.adaLN_modulation.1, which ComfyUI stores with diffusers' two halves swapped (a converter function):
# applied half by half; OFT/BOFT, which the pack does not split by rows, are refused there (the last test).
CONVERTED = "norm_out.linear"
RANK = 4
STRENGTHS = (1.0, 0.5)
TOLERANCE = 1e-4  # of the largest change of each weight (or row slice)


# --- ComfyUI's Flux, holding a diffusers Flux's weights ---------------------------------------------------------------

def comfy_flux(diffusers_model) -> comfy.model_patcher.ModelPatcher:
    """ComfyUI's Flux with the diffusers model's weights, converted the way ComfyUI loads a diffusers Flux."""
    # the converter writes the swapped norm_out halves back into the tensors it is given: hand it copies
    state = {k: v.detach().clone() for k, v in diffusers_model.state_dict().items()}
    converted = comfy.model_detection.convert_diffusers_mmdit(state, "")
    config = comfy.supported_models.Flux(dict(COMFY_CONFIG))
    config.set_inference_dtype(torch.float32, None)
    model = comfy.model_base.Flux(config, device=CPU)
    model.diffusion_model.load_state_dict(converted, strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


@pytest.fixture(scope="module")
def flux():
    """(ComfyUI's Flux ModelPatcher, the diffusers twin, {diffusers parameter name: ComfyUI target})."""
    torch.manual_seed(0)
    twin = FluxTransformer2DModel(**DIFFUSERS_CONFIG).float().eval()
    patcher = comfy_flux(twin)
    to_comfy = comfy.utils.flux_to_diffusers(COMFY_CONFIG, output_prefix="diffusion_model.")
    yield patcher, twin, to_comfy
    comfy.model_management.unload_all_models()


def test_the_diffusers_twin_computes_what_comfy_flux_computes(flux):
    patcher, twin, _ = flux
    gen = torch.Generator().manual_seed(1)
    x, context, pooled = torch.randn(1, 16, 4, 4, generator=gen), torch.randn(1, 3, 24, generator=gen), torch.randn(
        1, 20, generator=gen)
    t, guidance = torch.tensor([0.5]), torch.tensor([3.5])
    ids = torch.zeros(2, 2, 3)
    ids[..., 1], ids[..., 2] = torch.arange(2)[:, None], torch.arange(2)[None, :]
    packed = rearrange(x, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    with torch.no_grad():
        theirs = twin(hidden_states=packed, encoder_hidden_states=context, pooled_projections=pooled, timestep=t,
                      img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(3, 3), guidance=guidance).sample
        ours = patcher.model.diffusion_model(x, t, context, y=pooled, guidance=guidance)
    theirs = rearrange(theirs, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=2, w=2, ph=2, pw=2)
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


# --- adapters and files --------------------------------------------------------------------------------------------

ADDITIVE_TARGETS = TARGETS + [CONVERTED]


def _lora(targets, **options):
    return peft.LoraConfig(**{"r": RANK, "lora_alpha": RANK, "init_lora_weights": False, "target_modules": targets,
                              **options})


# kind -> config for these target modules
ADAPTERS = {
    "lora": lambda targets=ADDITIVE_TARGETS: _lora(targets),
    "lora-patterns": lambda targets=ADDITIVE_TARGETS: _lora(targets, lora_alpha=8,
                                                             rank_pattern={"proj_mlp": 2, "to_v": 6},
                                                             alpha_pattern={"to_k": 3, "ff.net.2": 12}),
    # lora_B with a bias, which PEFT's merge adds to the layer's bias at the LoRA's scale
    "lora-bias": lambda targets=ADDITIVE_TARGETS: _lora(targets, lora_bias=True, lora_alpha=8,
                                                         rank_pattern={"to_v": 2}, alpha_pattern={"proj_mlp": 3}),
    "dora": lambda targets=ADDITIVE_TARGETS: _lora(targets, use_dora=True),
    "loha": lambda targets=ADDITIVE_TARGETS: peft.LoHaConfig(r=RANK, alpha=8, init_weights=False,
                                                             target_modules=targets),
    "lokr": lambda targets=ADDITIVE_TARGETS: peft.LoKrConfig(r=RANK, alpha=8, init_weights=False, decompose_both=True,
                                                             target_modules=targets),
    "oft": lambda targets=TARGETS: peft.OFTConfig(r=0, oft_block_size=4, init_weights=False, target_modules=targets),
    "boft": lambda targets=TARGETS: peft.BOFTConfig(boft_block_size=4, boft_n_butterfly_factor=2, init_weights=False,
                                                    target_modules=targets),
    # feed-forward on the input side: a Linear of its own (ff.net.2) and a row slice of linear1 (proj_mlp)
    "ia3": lambda targets=ADDITIVE_TARGETS: peft.IA3Config(init_ia3_weights=False, target_modules=targets,
                                                  feedforward_modules=[t for t in ("ff.net.2", "proj_mlp")
                                                                       if t in targets]),
}
# diffusers' saver for LoRA-family files (with and without the config in lora_adapter_metadata); PEFT's for all
CASES = ([(kind, fmt) for kind in ("lora", "lora-patterns", "dora")
          for fmt in ("save_lora_weights", "save_lora_weights+metadata", "save_pretrained")
          if not (kind == "lora-patterns" and fmt == "save_lora_weights")]  # patterns live only in the config
         + [("lora-bias", "save_lora_weights+metadata"), ("lora-bias", "save_pretrained")]
         + [(kind, "save_pretrained") for kind in ("loha", "lokr", "oft", "boft", "ia3")]
         + [("ia3", "save_lora_weights")])
ROW_SPLIT = {"lora", "lora-patterns", "lora-bias", "dora", "loha", "lokr", "ia3"}  # also on norm_out.linear
WITHOUT_ALPHA = {("lora", "save_lora_weights"), ("dora", "save_lora_weights")}


def adapted(twin, config, save_format: str, seed: int):
    """A copy of the twin with a seeded PEFT adapter: wrapped in a PeftModel for save_pretrained, else injected as
    diffusers' training scripts do (`transformer.add_adapter`)."""
    torch.manual_seed(seed)
    base = copy.deepcopy(twin)
    if save_format == "save_pretrained":
        model = peft.get_peft_model(base, config)
    else:
        base.add_adapter(config)
        model = base
    # PEFT starts DoRA's magnitude at the weight norm (a no-op): move it so the file carries a real magnitude change
    for name, param in model.named_parameters():
        if "lora_magnitude_vector" in name:
            param.data.mul_(1 + 0.1 * torch.rand_like(param))
    return model


def save(model, config, kind: str, save_format: str, folder) -> list[str]:
    """The file(s) as the user gets them from this save helper; the safetensors file first."""
    if save_format == "save_pretrained":  # a folder: adapter_model.safetensors and its adapter_config.json
        model.save_pretrained(str(folder / kind))
        return [f"{kind}/adapter_model.safetensors", f"{kind}/adapter_config.json"]
    name = f"{kind}-{save_format}.safetensors"
    metadata = config.to_dict() if save_format.endswith("+metadata") else None
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=peft.get_peft_model_state_dict(model),
                                   weight_name=name, transformer_lora_adapter_metadata=metadata)
    return [name]


def merged_parameters(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers parameter name -> (before, after PEFT's own merge()) of every adapted layer, in float64; a bias
    only where the merge changes it."""
    merged = {}
    for name, module in copy.deepcopy(model).double().named_modules():
        if isinstance(module, BaseTunerLayer):
            layer = module.get_base_layer()
            before = {p: getattr(layer, p).detach().clone() for p in ("weight", "bias") if getattr(layer, p, None)
                      is not None}
            module.merge()
            name = name.removeprefix("base_model.model.")
            for param, value in before.items():
                after = getattr(layer, param).detach()
                if param == "weight" or not torch.equal(after, value):
                    merged[f"{name}.{param}"] = (value, after.clone())
    return merged


@pytest.fixture(scope="module")
def files(flux, tmp_path_factory):
    """(kind, format) -> ({path in the loras folder: bytes}, merged_parameters); each adapter built once."""
    _, twin, _ = flux
    folder = tmp_path_factory.mktemp("peft_dit")
    made = {}
    with pytest.MonkeyPatch.context() as patch:  # PEFT keeps >1 butterfly factor only with its CUDA kernel
        patch.setattr(boft_layer, "_FBD_CUDA", FakeBlockDiagKernel())
        for i, (kind, save_format) in enumerate(CASES):
            model = adapted(twin, ADAPTERS[kind](), save_format, seed=200 + i)
            written = save(model, ADAPTERS[kind](), kind, save_format, folder)
            made[kind, save_format] = ({n: (folder / n).read_bytes() for n in written}, merged_parameters(model))
    return made


def comfy_part(weights: dict[str, torch.Tensor], target) -> torch.Tensor:
    """The part of ComfyUI's weight a diffusers parameter is: a row slice of a fused one, or the whole."""
    if isinstance(target, str):
        return weights[target]
    key, offset = target[0], target[1]
    return weights[key] if offset is None else weights[key].narrow(*offset)


def in_comfy_layout(target, value: torch.Tensor) -> torch.Tensor:
    """A diffusers parameter's value as ComfyUI stores it: through the converter's function where it has one."""
    return target[2](value) if not isinstance(target, str) and len(target) > 2 else value


def comfy_key(target) -> str:
    return target if isinstance(target, str) else target[0]


def put(loras, written: dict[str, bytes]) -> str:
    for path, data in written.items():
        (loras / path).parent.mkdir(exist_ok=True)
        (loras / path).write_bytes(data)
    return next(iter(written))


def assert_weights_match(got: dict, base: dict, merged: dict, strength: float) -> None:
    """Every adapted weight (diffusers names) within TOLERANCE of its largest change of the truth at this strength,
    every other weight as it was."""
    for key, value in got.items():
        if key not in merged:
            assert torch.equal(value, base[key]), f"{key} changed @ {strength}"
            continue
        before, after = merged[key]
        change = strength * (after - before)
        assert change.abs().max() > 0, key
        error = (value.double() - (before + change)).abs().max()
        assert error <= TOLERANCE * change.abs().max(), f"{key} @ {strength}: {error:.3g}"


@pytest.mark.parametrize("kind,save_format", CASES)
def test_peft_file_on_flux_applies_fully_and_equal_to_peft_merge(kind, save_format, files, flux, loras):
    patcher, _, to_comfy = flux
    written, merged = files[kind, save_format]
    weights = {n: v for n, v in merged.items() if n.endswith(".weight")}
    top = {"transformer_blocks", "single_transformer_blocks", "proj_out"} | ({"norm_out"} if kind in ROW_SPLIT else set())
    assert {n.split(".")[0] for n in weights} == top
    assert any(not isinstance(to_comfy[n], str) for n in weights)  # row slices of qkv / linear1 among them
    biases = {n: v for n, v in merged.items() if n.endswith(".bias")}
    assert bool(biases) == (kind in ("lora-bias", "ia3"))  # PEFT's merge changes these biases
    checked = merged
    name = put(loras, written)

    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    if (kind, save_format) in WITHOUT_ALPHA:
        assert len(report.warnings) == 1 and "assumed alpha = rank" in report.warnings[0]
    else:
        assert report.warnings == []
    assert sorted(report.applied.values()) == sorted(comfy_key(to_comfy[n]) for n in checked)
    check_node_result(patcher, name, checked, to_comfy)


def check_node_result(patcher, name: str, merged: dict, to_comfy: dict, **options) -> None:
    """Our loader node at each strength, then ComfyUI's full load: each parameter is PEFT's merge, scaled."""
    keys = sorted({comfy_key(to_comfy[n]) for n in merged})
    for strength in STRENGTHS:
        patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength,
                           **options)[0]
        comfy.model_management.unload_all_models()
        got = weights_after_full_load(patched, keys)
        for diffusers_name, (before, after) in merged.items():
            target = to_comfy[diffusers_name]
            change = strength * (after - before)
            error = (comfy_part(got, target).double() - in_comfy_layout(target, before + change)).abs().max()
            assert error <= TOLERANCE * change.abs().max(), f"{diffusers_name} -> {target} @ {strength}: {error:.3g}"
    comfy.model_management.unload_all_models()


def test_peft_ia3_scales_each_normal_layers_bias_like_peft_merge(files, flux, loras):
    """PEFT's (IA)³ merge also scales the bias of a layer that is not feed-forward (b' = l·b), also on a row slice
    of qkv / linear1; a feed-forward layer's bias is left as it is."""
    patcher, _, to_comfy = flux
    written, merged = files["ia3", "save_pretrained"]
    biases = {n: v for n, v in merged.items() if n.endswith(".bias")}
    scaled_layers = {n.removesuffix(".bias") for n in biases}
    assert not {n for n in scaled_layers if n.endswith(("ff.net.2", "proj_mlp"))}  # feed-forward: bias unchanged
    assert any(not isinstance(to_comfy[n], str) for n in biases)  # qkv / linear1 bias slices among them
    name = put(loras, written)
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    assert sorted(v for v in report.applied.values() if v.endswith(".bias")) == sorted(
        comfy_key(to_comfy[n]) for n in biases)
    check_node_result(patcher, name, biases, to_comfy)


ROWS_REASON = "has no split by output rows"


@pytest.mark.parametrize("kind", ["oft", "boft"])
def test_adapter_without_a_row_split_is_refused_on_swapped_halves(kind, flux, loras, tmp_path):
    """norm_out.linear is ComfyUI's final_layer.adaLN_modulation.1 with its two halves swapped by a converter
    function: it applies as two modules, one per half. OFT and BOFT have no split by rows in the pack, so they are
    refused there with the reason (never applied through the converter function, which would hand them ComfyUI's
    rows in the wrong order); the rest applies."""
    patcher, twin, _ = flux
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(boft_layer, "_FBD_CUDA", FakeBlockDiagKernel())
        model = adapted(twin, ADAPTERS[kind]([CONVERTED, "to_q"]), "save_pretrained", seed=300)
        written = save(model, None, kind, "save_pretrained", tmp_path)
    name = put(loras, {n: (tmp_path / n).read_bytes() for n in written})
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert [key for key, _ in report.problems] == [f"base_model.model.{CONVERTED}.weight"]
    assert all(ROWS_REASON in reason for _, reason in report.problems)
    assert len(report.applied) == 4  # to_q of each double and single block


def test_auto_mode_on_flux_merges_a_float_model_like_merge(files, flux, loras):
    """apply_mode auto on a float model merges every layer, as merge does: the same weights as PEFT's merge, the
    converted norm_out.linear included."""
    patcher, _, to_comfy = flux
    written, merged = files["lora", "save_pretrained"]
    assert "norm_out.linear.weight" in merged
    check_node_result(patcher, put(loras, written), merged, to_comfy, apply_mode="auto")
