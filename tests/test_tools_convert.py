"""Convert LyCORIS (issue #14): kohya/LyCORIS names <-> diffusers/PEFT names, exactly, checked by the other side.

Sources are written by real tools on the diffusers twin of the tiny SD1.5 UNet (test_peft_diffusers_names.twin):
lycoris-lora 4.1.3's `create_lycoris` (SimpleTuner-style `lycoris_…` names, which ComfyUI maps) for LoCon with
Tucker convs, out-axis and in-axis DoRA, LoHa and (IA)³; PEFT + diffusers' own savers for LoRA, DoRA, rsLoRA and
rank/alpha patterns. Truths: our loader's patched weights for the source (itself tested against lycoris-lora and
PEFT elsewhere), PEFT's own merge after diffusers' `load_lora_adapter` of a converted file, ComfyUI's core loader
for kohya output. Tolerance: 1e-4 of the change (fp32).
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils
import pytest
import test_nodes
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_kohya
from lycoris import LycorisNetwork, create_lycoris, kohya
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.patch import change
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import lora_key_map
from lycoris_nodes.nodes.tools import convert as tool_convert
from lycoris_nodes.nodes.tools.convert import LycorisConvert
from node_runner import execute
from peft import LoraConfig, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import save_file
from test_peft_diffusers_names import twin  # noqa: F401  (fixture)
from test_peft_dit import comfy_part, flux  # noqa: F401  (fixture)

sd15 = test_nodes.sd15
loras = test_nodes.loras
TOLERANCE = 1e-4
REPO = Path(__file__).resolve().parent.parent
KOHYA_TO_Q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
BLOCK = "down_blocks.0.attentions.0."
# A few layers of each kind (Linear, 1x1 conv proj_in, 3x3 conv): the maths is per module, the time is per module.
LINEAR_TARGETS = [BLOCK + "transformer_blocks.0.attn1.to_q", BLOCK + "transformer_blocks.0.attn2.to_k",
                  BLOCK + "transformer_blocks.0.ff.net.2", "down_blocks.0.resnets.0.time_emb_proj", BLOCK + "proj_in"]
CONV_TARGETS = ["down_blocks.0.resnets.0.conv1"]


# --- sources made by real tools ------------------------------------------------------------------------------------

def lycoris_file(unet, folder, name, seed, **options) -> str:
    """A file lycoris-lora 4.1.3 writes for the diffusers UNet (its own names: `lycoris_<path>`)."""
    preset = folder / f"{name}.preset.toml"  # LyCORIS' own way to pick layers: anchored names, no module classes
    targets = ", ".join(f'"{path}$"' for path in LINEAR_TARGETS + CONV_TARGETS)
    # per-name settings: plain LoCon on these layers; LyCORIS keeps the map class-global, so it is always set
    plain = "".join(f'[name_algo_map."{path}$"]\nalgo = "locon"\nweight_decompose = false\n'
                    for path in options.pop("plain", ())) or "name_algo_map = {}\n"
    preset.write_text(f"target_module = []\ntarget_name = [{targets}]\n{plain}")
    try:
        network = create_lycoris(unet, 1.0, linear_dim=4, linear_alpha=2.0, conv_dim=4, conv_alpha=8.0,
                                 preset=str(preset), **options)
    finally:
        LycorisNetwork.apply_preset({"name_algo_map": {}})
    network.apply_to()  # registers the modules it saves; restored below (the UNet's weights are never touched)
    return randomized_save(network, folder, name, seed)


def randomized_save(network, folder, name: str, seed: int) -> str:
    """A network's own save_weights after random factors (a trained-looking file), its modules then taken off."""
    torch.manual_seed(seed)
    for param_name, param in network.named_parameters():
        if "dora_scale" in param_name:  # starts at ‖W‖: move it so the file carries a magnitude change
            param.data.mul_(1 + 0.1 * torch.rand_like(param))
        else:
            param.data = torch.randn_like(param) * 0.05
    network.save_weights(str(folder / name), torch.float32, {})
    network.restore()
    return name


def peft_file(unet, folder, name, seed, save_format, **config) -> str:
    """A PEFT adapter on the UNet saved by diffusers (`save_lora_weights` with its config) or as kohya names
    (`convert_state_dict_to_kohya`)."""
    base = copy.deepcopy(unet)
    base.add_adapter(LoraConfig(init_lora_weights=False, **config))
    torch.manual_seed(seed)
    for param_name, param in base.named_parameters():
        if "lora_magnitude_vector" in param_name:
            param.data.mul_(1 + 0.1 * torch.rand_like(param))
    state = get_peft_model_state_dict(base)
    if save_format == "kohya":
        save_file(convert_state_dict_to_kohya({f"unet.{k}": v for k, v in state.items()}), str(folder / name))
    else:
        metadata = LoraConfig(**config).to_dict()
        StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=state, weight_name=name,
                                                  unet_lora_adapter_metadata=metadata)
    return name


# --- truths --------------------------------------------------------------------------------------------------------

def patched_by_our_loader(model, name) -> dict[str, torch.Tensor]:
    """ComfyUI weight key -> W + ΔW (fp32) as our loader computes it for the file at strength 1."""
    lfile = read(name)
    _, report = map_file(lfile, model, None, reference=False)
    weights = model.model.state_dict()
    out = {}
    for applied in report.targets.values():  # a module on rows of a fused weight changes those rows
        key, offset = applied.target.key, applied.target.offset
        patched = out.setdefault(key, weights[key].float().clone())
        rows = patched if offset is None else patched.narrow(*offset.as_comfy())
        w = (weights[key] if offset is None else weights[key].narrow(*offset.as_comfy())).float()
        rows += change(applied.plan, {k: t.float() for k, t in applied.module.tensors.items()}, w, 1.0)
    return out


def merged_by_peft(unet, path, to_comfy) -> dict[str, torch.Tensor]:
    """diffusers' own reader (lora_state_dict + load_lora_adapter with the file's config), then PEFT's merge."""
    state, _alphas, metadata = StableDiffusionPipeline.lora_state_dict(str(path), return_lora_metadata=True)
    model = copy.deepcopy(unet)
    model.load_lora_adapter(state, prefix="unet", metadata=metadata, adapter_name="converted")
    merged = {}
    for module_name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
            merged[to_comfy[module_name + ".weight"]] = module.get_base_layer().weight.detach().float()
    return merged


def assert_same_changes(got: dict, want: dict, base: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, truth in want.items():
        change = truth - base[key].float()
        error = (got[key].reshape(truth.shape) - truth).norm() / change.norm()
        assert error <= TOLERANCE, f"{what}: {key}: {error:.2e} of the change"


def convert(name, target, model, output, **options):
    return execute(LycorisConvert, lycoris_name=name, target=target, model=model, output_name=output,
                   **options).result


def keys_of(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def metadata_of(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


# --- kohya/LyCORIS -> diffusers, read by diffusers and PEFT ----------------------------------------------------------

LYCORIS_SOURCES = {
    "locon-tucker": {"algo": "locon", "use_tucker": True},
    # out-axis DoRA (4 modules, Linear and conv) and 2 plain LoCon modules: PEFT's use_dora is one flag per
    # config, so the plain modules get the magnitude that keeps them plain
    "locon-dora-mixed": {"algo": "locon", "dora_wd": True, "wd_on_output": True, "plain": LINEAR_TARGETS[:2]},
    "loha": {"algo": "loha"},
    "lokr": {"algo": "lokr", "factor": 8},
    # DoRA normalises W + dW whatever form dW has: LoKr's exact LoRA plus the magnitude is PEFT's DoRA
    "lokr-dora": {"algo": "lokr", "factor": 8, "dora_wd": True, "wd_on_output": True},
}


@pytest.mark.parametrize("source", sorted(LYCORIS_SOURCES))
def test_lycoris_file_to_diffusers_loads_in_peft_equal_to_our_loader(source, sd15, twin, loras):  # noqa: F811
    model, _clip = sd15
    unet, to_comfy = twin
    name = lycoris_file(unet, loras, f"{source}.safetensors", seed=len(source), **dict(LYCORIS_SOURCES[source]))
    written, report = convert(name, "diffusers", model, f"out/{source}")
    assert written == f"out/{source}.safetensors"
    path = loras / written
    assert all(k.startswith("unet.") and ".lora_" in k for k in keys_of(path)), report
    base = model.model.state_dict()
    want = patched_by_our_loader(model, loras / name)
    got = merged_by_peft(unet, path, to_comfy)
    assert_same_changes(got, want, base, source)
    assert "not written" not in report
    if source == "locon-dora-mixed":
        plain = [m for m in read(loras / name).modules.values() if not m.has_dora]
        assert len(plain) == 2 and "unchanged" in report
    if source == "locon-tucker":
        assert "Tucker" in report
        mids = [k for k in read(loras / name).modules.values() if "lora_mid.weight" in k.tensors]
        assert mids  # the source had Tucker convs, folded exactly
    recorded = json.loads(metadata_of(path)["lycoris_nodes.modules"])
    # a plain module given DoRA's magnitude ‖W + dW‖: our loader's ε in the norm moves it by ~1e-7 of W
    assert max(r["error"] for r in recorded.values()) <= (TOLERANCE if "dora" in source else 1e-6)


def test_in_axis_dora_and_ia3_are_reported_and_error_mode_refuses(sd15, twin, loras):  # noqa: F811
    model, _clip = sd15
    unet, _ = twin
    name = lycoris_file(unet, loras, "dora-in.safetensors", seed=3, algo="locon", dora_wd=True, wd_on_output=False)
    total = len(read(loras / name).modules)
    with pytest.raises(LycorisError, match="no module converts to diffusers"):
        convert(name, "diffusers", model, "out/dora-in")
    assert not (loras / "out" / "dora-in.safetensors").exists()
    ia3 = lycoris_file(unet, loras, "ia3.safetensors", seed=4, algo="ia3")
    with pytest.raises(LycorisError, match="IA"):
        convert(ia3, "diffusers", model, "out/ia3", on_unconvertible="error")
    # kohya names hold every LyCORIS algorithm: the same file converts whole
    written, report = convert(name, "kohya", model, "out/dora-in-kohya")
    assert f"{total} modules" in report and "not written" not in report
    assert all(k.startswith("lora_unet_") for k in keys_of(loras / written))


# --- diffusers/PEFT -> kohya, read by ComfyUI's core loader and ours --------------------------------------------------

PEFT_SOURCES = {
    "lora-alpha": {"r": 4, "lora_alpha": 8, "target_modules": LINEAR_TARGETS + CONV_TARGETS},
    "rslora-patterns": {"r": 4, "lora_alpha": 6, "use_rslora": True, "target_modules": LINEAR_TARGETS,
                            "rank_pattern": {"to_q": 2}, "alpha_pattern": {"to_k": 3}},
    "dora": {"r": 4, "lora_alpha": 4, "use_dora": True, "target_modules": LINEAR_TARGETS},
}


def core_loader_patched(model, path) -> dict[str, torch.Tensor]:
    """ComfyUI's own LoRA loader (comfy.lora.load_lora + its weight calculation) on the kohya file."""
    sd = comfy.utils.load_torch_file(str(path))
    patches = comfy.lora.load_lora(sd, comfy.lora.model_lora_keys_unet(model.model, {}))
    weights = model.model.state_dict()
    return {key: comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], weights[key].float().clone(), key)
            for key, patch in patches.items()}


@pytest.mark.parametrize("source", sorted(PEFT_SOURCES))
def test_peft_file_to_kohya_loads_in_comfy_and_ours_like_the_source(source, sd15, twin, loras):  # noqa: F811
    model, _clip = sd15
    unet, _ = twin
    name = peft_file(unet, loras, f"{source}.safetensors", seed=len(source), save_format="diffusers",
                     **PEFT_SOURCES[source])
    written, report = convert(name, "kohya", model, f"out/{source}")
    path = loras / written
    assert all(k.startswith("lora_unet_") for k in keys_of(path))
    base = model.model.state_dict()
    want = patched_by_our_loader(model, loras / name)
    assert_same_changes(patched_by_our_loader(model, path), want, base, f"{source}: ours")
    if source != "dora":  # ComfyUI's core DoRA normalises the out-axis by W, not W + dW (spec 2.5 e)
        assert_same_changes(core_loader_patched(model, path), want, base, f"{source}: ComfyUI")
    else:
        assert "core loader" in report


def test_round_trip_kohya_diffusers_kohya_is_exact(sd15, twin, loras):  # noqa: F811
    """diffusers' convert_state_dict_to_kohya file -> diffusers -> kohya: the same tensors and the same scale."""
    model, _clip = sd15
    unet, _ = twin
    name = peft_file(unet, loras, "kohya-src.safetensors", seed=9, save_format="kohya", r=4, lora_alpha=4,
                     target_modules=LINEAR_TARGETS + CONV_TARGETS)
    there, _ = convert(name, "diffusers", model, "trip/there")
    back, _ = convert(there, "kohya", model, "trip/back")
    source, result = read(loras / name), read(loras / back)
    assert len(result.modules) == len(source.modules)
    by_weight = {}
    for lfile in (source, result):
        _, report = map_file(lfile, model, None, reference=False)
        for applied in report.targets.values():
            by_weight.setdefault(applied.target.key, []).append(applied.module)
    for key, (a, b) in by_weight.items():
        assert a.layout.scale == pytest.approx(b.layout.scale, rel=1e-7), key
        for suffix, tensor in a.tensors.items():
            assert torch.equal(tensor, b.tensors[suffix].reshape(tensor.shape)), f"{key}.{suffix}"


def test_refusals(sd15, twin, loras):  # noqa: F811
    model, _clip = sd15
    unet, _ = twin
    name = peft_file(unet, loras, "small.safetensors", seed=1, save_format="kohya", r=2, lora_alpha=2,
                     target_modules=LINEAR_TARGETS[:1])
    convert(name, "diffusers", model, "refuse/one")
    before = (loras / "refuse" / "one.safetensors").read_bytes()
    with pytest.raises(LycorisError, match="exists"):
        convert(name, "diffusers", model, "refuse/one")
    assert (loras / "refuse" / "one.safetensors").read_bytes() == before
    convert(name, "kohya", model, "refuse/one", overwrite=True)
    assert (loras / "refuse" / "one.safetensors").read_bytes() != before
    with pytest.raises(LycorisError, match="loras folder"):
        convert(name, "kohya", model, "../outside")


def test_diffusers_names_are_what_save_lora_weights_writes(sd15):
    model, clip = sd15
    names = tool_convert.diffusers_names({**lora_key_map(model.model, False), **lora_key_map(clip.cond_stage_model, True)})
    assert names[test_nodes.TO_Q_KEY].startswith("unet.down_blocks.") and names[test_nodes.TO_Q_KEY].endswith(
        ".attn1.to_q")
    assert names[test_nodes.TE_Q_KEY] == "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"


def test_text_encoder_module_converts_under_diffusers_name(sd15, loras):
    """A kohya `lora_te_` module with the CLIP connected: written as `text_encoder.text_model.…`, read back by our
    loader onto the same CLIP weight with the same change; without the CLIP it is listed, not dropped."""
    model, clip = sd15
    source = test_nodes.write(loras, "te.safetensors", {**test_nodes.lora(test_nodes.TE_Q, 768, 768, seed=5),
                                                        **test_nodes.lora(KOHYA_TO_Q, 320, 320, seed=7)})
    written, _ = convert(source, "diffusers", model, "te/out", clip=clip)
    assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight" in keys_of(loras / written)
    changes = []
    for name in (source, written):
        _, report = map_file(read(loras / name), model, clip, reference=False)
        applied = next(a for a in report.targets.values() if a.target.key == test_nodes.TE_Q_KEY)
        w = clip.cond_stage_model.state_dict()[test_nodes.TE_Q_KEY].float()
        changes.append(change(applied.plan, {k: t.float() for k, t in applied.module.tensors.items()}, w, 1.0))
    assert float((changes[1] - changes[0]).norm() / changes[0].norm()) <= 1e-6
    _, report = convert(source, "diffusers", model, "te/no-clip")
    assert "no CLIP is connected" in report


def test_cli_converts_with_a_checkpoint(tmp_path):
    """The command line: a kohya file and the checkpoint's path in, the diffusers names out (one run: ~20 s of
    ComfyUI start and checkpoint load; refusals are the node's, tested above)."""
    lora_dir = tmp_path / "models" / "loras"
    lora_dir.mkdir(parents=True)
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file(test_nodes.lora(key, 320, 320, seed=1), str(lora_dir / "one.safetensors"))
    comfy_dir = os.environ.get("COMFYUI_PATH", str(REPO / ".deps" / "ComfyUI"))
    run = subprocess.run([sys.executable, str(REPO / "lycoris_tools.py"), "--comfyui", comfy_dir, "--cpu",
                          "--base-directory", str(tmp_path), "convert", "one.safetensors", "--to", "diffusers",
                          "--checkpoint", str(test_nodes._tiny_sd15_path()), "-o", "one-diffusers"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "1 modules" in run.stdout
    assert keys_of(lora_dir / "one-diffusers.safetensors") == {
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight",
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight"}


def test_save_dtype_casts_and_reports_the_rounding(sd15, twin, loras):  # noqa: F811
    model, _clip = sd15
    unet, to_comfy = twin
    name = peft_file(unet, loras, "cast.safetensors", seed=2, save_format="diffusers", r=4, lora_alpha=4,
                     target_modules=LINEAR_TARGETS[:2])
    written, report = convert(name, "kohya", model, "cast/bf16", dtype="bf16")
    with safe_open(str(loras / written), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {d for k, d in dtypes.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    assert {d for k, d in dtypes.items() if k.endswith(".alpha")} == {torch.float32}  # a scale, kept exact
    assert "saved in bf16" in report
    # The error each module reports against the one measured without our maths: the source merged by PEFT, the bf16
    # file applied by ComfyUI's core loader, ‖W_core − W_peft‖ / ‖W_peft − W₀‖ per weight (3 digits kept).
    recorded = json.loads(metadata_of(loras / written)["lycoris_nodes.modules"])
    truth = merged_by_peft(unet, loras / name, to_comfy)
    key_map = lora_key_map(model.model, False)
    core, _ = comfy.sd.load_lora_for_models(model, None, comfy.utils.load_torch_file(str(loras / written)), 1.0, 0.0)
    got = test_nodes.weights_after_full_load(core, list(truth))
    base = model.model.state_dict()
    assert {key_map[module] for module in recorded} == set(truth)
    for module, record in recorded.items():
        key = key_map[module]
        measured = float((got[key].float() - truth[key]).norm() / (truth[key] - base[key].float()).norm())
        assert 1e-4 < measured < 1e-2, (module, measured)  # bf16's rounding of the factors: there, and small
        assert record["error"] == pytest.approx(measured, rel=1e-2), module


# --- a DiT: Flux's fused weights, split into diffusers' layers -------------------------------------------------------

# kohya's Flux names (lycoris-lora's kohya wrapper on ComfyUI's own Flux module): the fused qkv / linear1 whole
FLUX_LAYERS = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_attn.qkv", "single_blocks.0.linear1",
               "double_blocks.0.img_mlp.0"]


def kohya_flux_file(diffusion_model, folder, name, seed, **options) -> str:
    preset = folder / f"{name}.preset.toml"
    targets = ", ".join(f'"{layer}$"' for layer in FLUX_LAYERS)
    preset.write_text(f"unet_target_module = []\nunet_target_name = [{targets}]\n"
                      "text_encoder_target_module = []\ntext_encoder_target_name = []\n")
    network = kohya.create_network(1.0, 4, 2.0, None, None, diffusion_model, warn_on_unmatched=False,
                                   preset=str(preset), **options)
    network.apply_to(None, diffusion_model, apply_text_encoder=False, apply_unet=True)
    return randomized_save(network, folder, name, seed)


FLUX_SOURCES = {"lora": {"algo": "locon"}, "dora": {"algo": "locon", "dora_wd": True}}


@pytest.mark.parametrize("kind", sorted(FLUX_SOURCES))
def test_flux_fused_weights_split_into_diffusers_layers_load_in_peft(kind, flux, loras):  # noqa: F811
    """A module on Flux's fused qkv / linear1 becomes one LoRA per diffusers layer (to_q, to_k, to_v, proj_mlp):
    lora_B's rows (and DoRA's magnitude rows) split, lora_A shared. diffusers loads the file into its own Flux
    and PEFT's merge equals our loader's patch of the source, part by part."""
    patcher, flux_twin, to_comfy = flux
    name = kohya_flux_file(patcher.model.diffusion_model, loras, f"flux-{kind}.safetensors", seed=11,
                           **FLUX_SOURCES[kind])
    assert all(k.startswith("lora_unet_") for k in keys_of(loras / name))
    written, report = convert(name, "diffusers", patcher, f"flux/{kind}")
    assert "not written" not in report, report
    keys = keys_of(loras / written)
    assert "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight" in keys
    assert "transformer.transformer_blocks.1.attn.add_v_proj.lora_A.weight" in keys

    state, metadata = FluxPipeline.lora_state_dict(str(loras / written), return_lora_metadata=True)
    model = copy.deepcopy(flux_twin)
    model.load_lora_adapter(state, prefix="transformer", metadata=metadata, adapter_name="converted")
    ours = patched_by_our_loader(patcher, loras / name)
    checked = 0
    for module_name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            before = module.get_base_layer().weight.detach().clone()
            module.merge()
            target = to_comfy[module_name + ".weight"]
            got = module.get_base_layer().weight.detach() - before
            want = comfy_part(ours, target) - comfy_part(patcher.model.state_dict(), target).float()
            assert float((got - want).norm() / want.norm()) <= TOLERANCE, module_name
            checked += 1
    assert checked == 3 + 3 + 4 + 1, sorted({k.rsplit(".lora", 1)[0] for k in keys})  # img/txt q/k/v, single q/k/v/mlp, img_mlp.0


def test_flux_diffusers_layers_join_into_kohya_fused_weights(flux, loras):  # noqa: F811
    """A PEFT LoRA on diffusers' Flux layers (saved by diffusers) to kohya: the parts of one fused weight (to_q,
    to_k, to_v of qkv; also proj_mlp of linear1) become one LoRA on it, ranks side by side. ComfyUI's core loader
    and ours patch the kohya file as ours patches the source."""
    patcher, flux_twin, _ = flux
    model = copy.deepcopy(flux_twin)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                 target_modules=["to_q", "to_k", "to_v", "proj_mlp", "add_k_proj", "ff.net.2"]))
    FluxPipeline.save_lora_weights(str(loras), transformer_lora_layers=get_peft_model_state_dict(model),
                                   weight_name="flux-peft.safetensors",
                                   transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
    written, report = convert("flux-peft.safetensors", "kohya", patcher, "flux/joined")
    assert "not written" not in report and "parts of a fused weight joined" in report, report
    keys = keys_of(loras / written)
    assert "lora_unet_single_blocks_0_linear1.lora_up.weight" in keys
    assert "lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight" in keys  # add_k_proj alone: rows 32..64
    want = patched_by_our_loader(patcher, loras / "flux-peft.safetensors")
    base = patcher.model.state_dict()
    assert_same_changes(patched_by_our_loader(patcher, loras / written), want, base, "ours")
    core = {}
    sd = comfy.utils.load_torch_file(str(loras / written))
    for key, patch in comfy.lora.load_lora(sd, comfy.lora.model_lora_keys_unet(patcher.model, {})).items():
        core[key] = comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], base[key].float().clone(), key)
    assert_same_changes(core, want, base, "ComfyUI")
