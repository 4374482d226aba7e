"""PEFT / diffusers adapter files, written by their own save helpers, applied through ComfyUI's key maps.

The tiny SD1.5 UNet ComfyUI loads is rebuilt as a diffusers `UNet2DConditionModel` through ComfyUI's own name map
(`comfy.utils.unet_to_diffusers`; one forward of each checks the conversion). PEFT attaches LoRA / DoRA adapters to
it, the adapters are saved every way users get them, and each file goes through our loader node into ComfyUI's
model. Truth is PEFT's own `merge()` of the same adapter, in float64; alpha == rank throughout (reading alpha from
metadata is tested elsewhere).
"""

import copy
import dataclasses
import json
import logging

import comfy.lora
import comfy.model_management
import comfy.utils
import pytest
import test_nodes
import torch
from comfy.ldm.flux.model import FluxParams
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_kohya
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import lora_key_map
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from patcher_util import assert_rounded_from
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import save_file
from test_nodes import LOGGER, run_node, weights_after_full_load
from test_trainer_names import SDXL_CONFIG  # ComfyUI's own SDXL UNet config
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

sd15 = test_nodes.sd15
loras = test_nodes.loras

# Linear layers, 1×1 convs (proj_in/out, as SD1.5 has them), 3×3 convs and the up blocks' 1×1 conv_shortcut.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                "time_emb_proj", "conv1", "conv2", "conv_shortcut"]
# DoRA on Linear layers and square convs (1×1 proj_in/out, 3×3 conv2): the pack refuses PEFT's DoRA on a
# non-square conv (conv1/conv_shortcut of the up blocks), whose magnitude layout is ambiguous.
DORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
                "time_emb_proj", "conv2"]
SAVE_FORMATS = ["save_lora_weights", "save_lora_weights+metadata", "diffusers_training", "kohya", "save_pretrained"]
# Files whose tensors and metadata carry no alpha: applied at alpha = rank with one warning (alpha == rank here).
WITHOUT_ALPHA = {"save_lora_weights", "diffusers_training"}
CASES = [(kind, f) for kind in ("lora", "dora") for f in SAVE_FORMATS]
RANK = 4
TOLERANCE = 1e-4  # of the largest change of each weight


# --- the diffusers twin of ComfyUI's UNet -------------------------------------------------------------------------

def diffusers_config(unet_config: dict) -> dict:
    """UNet2DConditionModel arguments for ComfyUI's SD1-style unet_config (uniform res blocks, no ADM)."""
    blocks = len(unet_config["channel_mult"])
    with_attention = [depth > 0 for depth in unet_config["transformer_depth"][:blocks]]
    return {
        "sample_size": unet_config["image_size"], "in_channels": unet_config["in_channels"],
        "out_channels": unet_config["out_channels"],
        "block_out_channels": [unet_config["model_channels"] * m for m in unet_config["channel_mult"]],
        "layers_per_block": unet_config["num_res_blocks"][0],
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in with_attention],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(with_attention)],
        "cross_attention_dim": unet_config["context_dim"], "attention_head_dim": unet_config["num_heads"],
        "use_linear_projection": unet_config["use_linear_in_transformer"],
    }


@pytest.fixture(scope="module")
def twin(sd15):
    """(diffusers UNet carrying ComfyUI's weights, {diffusers weight name: ComfyUI weight key})."""
    model, _clip = sd15
    unet_config = model.model.model_config.unet_config
    to_comfy = {name: f"diffusion_model.{key}" for name, key in comfy.utils.unet_to_diffusers(unet_config).items()}
    unet = UNet2DConditionModel(**diffusers_config(unet_config)).float().eval()
    comfy_sd = model.model.state_dict()
    unet.load_state_dict({name: comfy_sd[to_comfy[name]].float() for name in unet.state_dict()}, strict=True)
    return unet, to_comfy


def test_the_diffusers_twin_computes_what_comfy_unet_computes(sd15, twin):
    model, _clip = sd15
    unet, _ = twin
    gen = torch.Generator().manual_seed(0)
    x, context = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(1, 5, 768, generator=gen)
    t = torch.tensor([321.0])
    with torch.no_grad():
        ours = model.model.diffusion_model(x, timesteps=t, context=context)
        theirs = unet(x, t, encoder_hidden_states=context).sample
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


# --- files written by PEFT / diffusers ----------------------------------------------------------------------------

def adapter_config(kind: str) -> LoraConfig:
    targets = DORA_TARGETS if kind == "dora" else LORA_TARGETS
    return LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights=False, target_modules=targets,
                      use_dora=kind == "dora")


def adapted(unet, kind: str, save_format: str, seed: int):
    """A copy of the UNet with a seeded PEFT adapter: wrapped in a PeftModel for save_pretrained, else injected
    the way diffusers' training scripts do (`unet.add_adapter`)."""
    torch.manual_seed(seed)
    base = copy.deepcopy(unet)
    if save_format == "save_pretrained":
        return get_peft_model(base, adapter_config(kind))
    base.add_adapter(adapter_config(kind))
    # PEFT starts DoRA's magnitude at the weight norm (a no-op): move it so the file carries a real magnitude change.
    for name, param in base.named_parameters():
        if "lora_magnitude_vector" in name:
            param.data.mul_(1 + 0.1 * torch.rand_like(param))
    return base


def save(model, kind: str, save_format: str, folder) -> str:
    """The file as the user gets it from this save helper; returns its name in the loras folder."""
    name = f"{kind}-{save_format}.safetensors"
    if save_format == "save_pretrained":  # a folder: adapter_model.safetensors and its adapter_config.json
        model.save_pretrained(str(folder / f"{kind}-peft"))
        return f"{kind}-peft/adapter_model.safetensors"
    peft_sd = get_peft_model_state_dict(model)
    if save_format == "kohya":
        save_file(convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_sd.items()}), str(folder / name))
        return name
    if save_format == "diffusers_training":
        peft_sd = convert_state_dict_to_diffusers(peft_sd)
    metadata = adapter_config(kind).to_dict() if save_format.endswith("+metadata") else None
    StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=peft_sd, weight_name=name,
                                              unet_lora_adapter_metadata=metadata)
    return name


def merged_weights(model) -> dict[str, torch.Tensor]:
    """diffusers weight name -> PEFT's own merge() of the adapter into that layer, in float64."""
    merged = {}
    for name, module in copy.deepcopy(model).double().named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[name.removeprefix("base_model.model.") + ".weight"] = module.get_base_layer().weight.detach()
    return merged


@pytest.fixture(scope="module")
def files(twin, tmp_path_factory):
    """(kind, format) -> {path in the loras folder: bytes}, float64 merged weights by diffusers name; each adapter
    built once."""
    unet, _ = twin
    folder = tmp_path_factory.mktemp("peft_files")
    made = {}
    for i, (kind, save_format) in enumerate(CASES):
        model = adapted(unet, kind, save_format, seed=100 + i)
        name = save(model, kind, save_format, folder)
        written = [name] + ([name.replace("adapter_model.safetensors", "adapter_config.json")]
                            if save_format == "save_pretrained" else [])
        made[kind, save_format] = ({n: (folder / n).read_bytes() for n in written}, merged_weights(model))
    return made


def test_the_files_carry_the_names_users_get(files):
    """The table covers each name style: checked on the files themselves, so a change in diffusers shows here."""
    expected = {"save_lora_weights": "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
                "diffusers_training": "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora.down.weight",
                "kohya": "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
                "save_pretrained": "base_model.model.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
                                   ".lora_A.weight"}
    for save_format, key in expected.items():
        written, _ = files["lora", save_format]
        assert key in safetensors_keys(next(iter(written.values()))), save_format


def safetensors_keys(data: bytes) -> set[str]:
    header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
    return set(header) - {"__metadata__"}


@pytest.mark.parametrize("kind,save_format", CASES)
def test_peft_file_applies_fully_and_equal_to_peft_merge(kind, save_format, files, twin, sd15, loras, caplog):
    model, _clip = sd15
    _, to_comfy = twin
    written, merged = files[kind, save_format]
    for path, data in written.items():
        (loras / path).parent.mkdir(exist_ok=True)
        (loras / path).write_bytes(data)
    name = next(iter(written))

    lfile = read(loras / name)
    _, report = map_file(lfile, model, None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    if save_format in WITHOUT_ALPHA:
        assert len(report.warnings) == 1 and "assumed alpha = rank" in report.warnings[0]
    else:
        assert report.warnings == []
    assert sorted(report.applied.values()) == sorted(to_comfy[n] for n in merged)

    keys = [to_comfy[n] for n in merged]
    originals = {k: v.detach().clone() for k, v in model.model.state_dict().items() if k in keys}
    for strength in (1.0, 0.5):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            patched = run_node(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=strength)[0]
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not [w for w in warned if "assumed alpha = rank" not in w]  # nothing unmatched, nothing refused
        comfy.model_management.unload_all_models()
        got = weights_after_full_load(patched, keys)
        for diffusers_name, truth in merged.items():
            key = to_comfy[diffusers_name]
            base = originals[key].double()
            change = strength * (truth.reshape(base.shape) - base)
            error = (got[key].double() - (base + change)).abs().max()
            assert error <= TOLERANCE * change.abs().max(), f"{key} @ {strength}: {error:.3g}"
    comfy.model_management.unload_all_models()


# --- names on every prefix -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "unet.", "base_model.model.", "unet.base_model.model."])
def test_every_unet_module_path_maps_under_each_peft_prefix(prefix, sd15):
    model, _clip = sd15
    key_map = lora_key_map(model.model, is_clip=False)
    diffusers_names = comfy.utils.unet_to_diffusers(model.model.model_config.unet_config)
    wrong = {}
    for name, key in diffusers_names.items():
        if name.endswith(".weight"):
            path = prefix + name[: -len(".weight")]
            if key_map.get(path) != f"diffusion_model.{key}":
                wrong[path] = key_map.get(path)
    assert not wrong, f"{len(wrong)} unmapped or wrong, e.g. {next(iter(wrong.items()))}"


def test_comfy_entries_win(sd15):
    """Every entry ComfyUI's own map has is in ours unchanged."""
    model, clip = sd15
    for module, is_clip, build in ((model.model, False, comfy.lora.model_lora_keys_unet),
                                   (clip.cond_stage_model, True, comfy.lora.model_lora_keys_clip)):
        ours = lora_key_map(module, is_clip)
        theirs = build(module, {})
        assert {k: ours.get(k) for k in theirs} == theirs


# --- a DiT: Flux, built on the meta device -------------------------------------------------------------------------

FLUX_CONFIG = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 64,
               "context_in_dim": 64, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
               "depth_single_blocks": 2, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True,
               "guidance_embed": True}
if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
    FLUX_CONFIG["txt_ids_dims"] = []  # 0.33's Flux also takes the text position-id layout; 0.3.75's has none


@pytest.fixture(scope="module")
def tiny_flux():
    import comfy.model_base
    import comfy.supported_models

    config = comfy.supported_models.Flux(dict(FLUX_CONFIG))
    with torch.device("meta"):
        return comfy.model_base.Flux(config, device="meta")


@pytest.mark.parametrize("prefix", ["", "transformer.", "base_model.model."])
def test_every_flux_diffusers_name_maps_to_its_weight(prefix, tiny_flux):
    """Flux's diffusers names differ from ComfyUI's (and split its fused qkv): each maps to ComfyUI's converter
    target, row offset included, under every prefix (controlnet-only names, absent from this model, left out)."""
    key_map = lora_key_map(tiny_flux, is_clip=False)
    weights = set(tiny_flux.state_dict())
    names = comfy.utils.flux_to_diffusers(tiny_flux.model_config.unet_config, output_prefix="diffusion_model.")
    present = {name: target for name, target in names.items()
               if name.endswith(".weight") and (target if isinstance(target, str) else target[0]) in weights}
    wrong = {prefix + name[: -len(".weight")]: target for name, target in present.items()
             if key_map.get(prefix + name[: -len(".weight")]) != target}
    assert len(present) > 40 and not wrong, f"{len(wrong)} unmapped or wrong, e.g. {next(iter(wrong.items()), None)}"


# --- the text encoder ----------------------------------------------------------------------------------------------

def comfy_clip_key(name: str) -> str:
    """ComfyUI's CLIP-L key of a transformers weight name (transformers 5's CLIPTextModel has no `text_model.`)."""
    inner = name if name.startswith(("text_model.", "text_projection.")) else "text_model." + name
    return "clip_l.transformer." + inner


# save_lora_weights of a PeftModel's state dict: `text_encoder.base_model.model.…` (a text encoder wrapped by
# get_peft_model, saved by diffusers)
TEXT_CASES = [(CLIPTextModel, "save_lora_weights"), (CLIPTextModel, "save_pretrained"),
              (CLIPTextModel, "save_lora_weights+peft_model"), (CLIPTextModelWithProjection, "save_lora_weights")]


@pytest.mark.parametrize("cls,save_format", TEXT_CASES, ids=lambda x: getattr(x, "__name__", x))
def test_peft_lora_on_the_clip_text_model_maps_to_comfy_clip(cls, save_format, sd15, loras):
    """A PEFT LoRA on a transformers CLIP text model carrying ComfyUI's CLIP-L weights, saved by diffusers
    (`text_encoder.` prefix) or PEFT (`base_model.model.`): every module maps to the ComfyUI CLIP weight of the same
    layer, and the applied change equals PEFT's merge."""
    model, clip = sd15
    csd = clip.cond_stage_model.state_dict()
    text_model = cls(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, projection_dim=768)).float()
    text_model.load_state_dict({k: csd[comfy_clip_key(k)].float() for k in text_model.state_dict()}, strict=True)
    torch.manual_seed(7)
    targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    config = LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights=False, target_modules=targets)
    name = f"te-{cls.__name__}-{save_format}.safetensors"
    if save_format == "save_pretrained":
        wrapped = get_peft_model(text_model, config)
        wrapped.save_pretrained(str(loras / "te-peft"))
        (loras / name).write_bytes((loras / "te-peft" / "adapter_model.safetensors").read_bytes())
    else:  # what transformers' `add_adapter` does (it asks for peft >= 0.22 here), or a PeftModel; diffusers' saver
        wrapped = (get_peft_model(text_model, config) if save_format.endswith("+peft_model")
                   else inject_adapter_in_model(config, text_model))
        StableDiffusionPipeline.save_lora_weights(str(loras), text_encoder_lora_layers=get_peft_model_state_dict(
            wrapped), weight_name=name)
        if save_format.endswith("+peft_model"):
            keys = safetensors_keys((loras / name).read_bytes())
            assert keys and all(k.startswith("text_encoder.base_model.model.") for k in keys)
    merged = {comfy_clip_key(n): w for n, w in merged_weights(wrapped).items()}

    _, report = map_file(read(loras / name), None, clip, reference=False)
    assert report.problems == [] and report.unused_keys == [] and len(report.applied) == 12 * len(targets)
    assert sorted(report.applied.values()) == sorted(merged)
    if save_format.endswith("+peft_model"):
        return  # the names are the point here: the same LoRA's maths is checked by the other cases (~30 s each)

    _m, patched = run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.0,
                           strength_clip=1.0)
    comfy.model_management.unload_all_models()  # a CLIP ComfyUI loaded earlier counts its weights as patched
    got = weights_after_full_load(patched.patcher, list(merged))
    for key, truth in merged.items():  # ComfyUI keeps this CLIP in fp16: the patched weight is the truth rounded
        assert_rounded_from(got[key], truth, got[key].dtype, what=key)


# --- SDXL on the meta device: two text encoders, and the UNet's diffusers names --------------------------------------


def test_sdxl_text_encoders_map_to_their_own_clip_and_peft_names_only_when_unambiguous():
    import comfy.sdxl_clip

    clip_model = comfy.sdxl_clip.SDXLClipModel(device="meta")
    key_map = lora_key_map(clip_model, is_clip=True)
    weights = [k for k in clip_model.state_dict() if k.endswith(".weight")]
    for prefix, root in (("text_encoder.", "clip_l.transformer."), ("text_encoder_2.", "clip_g.transformer.")):
        mine = [k for k in weights if k.startswith(root)]
        assert len(mine) >= 100  # 12 or 32 layers of 8 weights, embeddings, norms
        for key in mine:
            path = key[len(root): -len(".weight")]
            assert key_map.get(prefix + path) == key, prefix + path
            assert key_map.get(prefix + path.removeprefix("text_model.")) == key  # transformers 5's CLIPTextModel
    # `base_model.model.` does not say which of the two encoders: no such name maps, not even clip_g's layer 31
    assert not [k for k in key_map if k.startswith("base_model.model.")]


def test_sdxl_unet_diffusers_names_map_under_each_prefix():
    import comfy.model_base
    import comfy.supported_models

    with torch.device("meta"):
        unet = comfy.model_base.SDXL(comfy.supported_models.SDXL(dict(SDXL_CONFIG)), device="meta")
    key_map = lora_key_map(unet, is_clip=False)
    names = {n[: -len(".weight")]: f"diffusion_model.{k}"
             for n, k in comfy.utils.unet_to_diffusers(unet.model_config.unet_config).items() if n.endswith(".weight")}
    assert "add_embedding.linear_1" in names and len(names) > 1000
    for prefix in ("", "unet.", "base_model.model.", "unet.base_model.model."):
        wrong = {prefix + n: key_map.get(prefix + n) for n, k in names.items() if key_map.get(prefix + n) != k}
        assert not wrong, f"{len(wrong)} unmapped or wrong, e.g. {next(iter(wrong.items()))}"


# --- T5 (Flux's text_encoder_2, SD3's text_encoder_3) and PEFT's wrapper after a pipeline prefix --------------------

T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}


def _meta_clip(arch: str):
    import comfy.text_encoders.flux
    import comfy.text_encoders.sd3_clip

    if arch == "flux":
        return comfy.text_encoders.flux.FluxClipModel(device="meta", dtype=torch.float16)
    return comfy.text_encoders.sd3_clip.SD3ClipModel(device="meta", dtype=torch.float16)


@pytest.mark.parametrize("arch,pipe", [("flux", "text_encoder_2."), ("sd3", "text_encoder_3.")])
def test_t5_names_map_to_comfy_t5(arch, pipe):
    """transformers' T5EncoderModel (T5-XXL, on the meta device) names every weight the way PEFT and diffusers write
    it under the pipeline's prefix; each maps to ComfyUI's T5 weight of the same shape. ComfyUI's own map has only
    kohya names for T5 (`lora_te2_…` on Flux, `lora_te3_…` on SD3): the prefix is the pipeline's Nth encoder."""
    from transformers import T5Config, T5EncoderModel

    clip_model = _meta_clip(arch)
    key_map = lora_key_map(clip_model, is_clip=True)
    shapes = {k: tuple(v.shape) for k, v in clip_model.state_dict().items()}
    with torch.device("meta"):
        t5 = T5EncoderModel(T5Config(**T5_XXL))
    names = {n: tuple(p.shape) for n, p in t5.named_parameters() if n.endswith(".weight") and "norm" not in n}
    assert len(names) > 24 * 7  # q, k, v, o, wi_0, wi_1, wo in each block
    for name, shape in names.items():
        path = name[: -len(".weight")]
        for prefix in (pipe, pipe + "base_model.model."):
            key = key_map.get(prefix + path)
            assert key == f"t5xxl.transformer.{name}" and shapes[key] == shape, (prefix + path, key)
    assert not [k for k in key_map if k.startswith("base_model.model.")]  # two encoders: a bare PEFT name is ambiguous


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_clip_names_keep_their_encoder_next_to_t5(arch):
    """Adding T5's prefix moves no CLIP name: text_encoder. stays CLIP-L (and SD3's text_encoder_2. CLIP-G)."""
    clip_model = _meta_clip(arch)
    key_map = lora_key_map(clip_model, is_clip=True)
    q_proj = "text_model.encoder.layers.0.self_attn.q_proj"
    assert key_map["text_encoder." + q_proj] == f"clip_l.transformer.{q_proj}.weight"
    assert key_map["text_encoder.base_model.model." + q_proj] == f"clip_l.transformer.{q_proj}.weight"
    if arch == "sd3":
        assert key_map["text_encoder_2." + q_proj] == f"clip_g.transformer.{q_proj}.weight"
