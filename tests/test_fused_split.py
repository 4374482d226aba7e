"""A fused module whose ComfyUI weights are separate, split by rows onto them: Krea 2's fused q/k/v.

SimpleTuner trains Krea 2 with `--fuse_qkv_projections` (its documented default, documentation/quickstart/KREA2.md):
bghira/SimpleTuner simpletuner/helpers/models/krea2/model.py `Krea2.get_lora_target_layers` then targets
FUSED_LORA_TARGET = ["to_qkv", "to_out.0"], and `Krea2Attention.fuse_projections` (its vendored copy of diffusers'
transformer_krea2.py, which diffusers 0.42.1 ships: `AttentionModuleMixin.fuse_projections`, reached through
`Krea2Transformer2DModel.fuse_qkv_projections`) adds `to_qkv` = cat(to_q, to_k, to_v) by rows and keeps to_q/to_k/to_v.
Files: a PEFT LoRA/DoRA saved by `save_lora_weights` (SimpleTuner's `_save_lora`,
simpletuner/helpers/training/save_hooks.py, calls the pipeline's `save_lora_weights` with
`get_peft_model_state_dict`), and a LyCORIS network saved as its `_save_lycoris` does (`LycorisNetwork.save_weights`,
`lycoris_` + the diffusers path with dots as underscores) over a class preset on `Krea2Attention`, which wraps the
kept to_q/to_k/to_v too: the per-projection entries ComfyUI 0.38's `comfy.lora_convert.convert_fused_qkv_lora`
drops as unused duplicates. ComfyUI keeps q, k and v separate (`blocks.N.attn.wq/wk/wv`, GQA: k and v have fewer
rows than q; `txtfusion.layerwise_blocks.N` / `refiner_blocks.N` likewise), with names from
`comfy.utils.krea2_to_diffusers`.

Model: ComfyUI 0.33's own Krea2 (`comfy.supported_models.Krea2`) at a tiny width, fp32 on the CPU; its twin is
diffusers' Krea2Transformer2DModel of the same sizes holding ComfyUI's attention weights (copied by ComfyUI's own
name map), then fused. Truth, in float64: PEFT's `merge()` of each to_qkv / to_out.0, and the LyCORIS network's
forward on the identity (never its merge_to). Each file goes through our loader node at strengths 1 and 0.5, merged
(the weights after a full load) and bypassed (each layer's response to unit inputs); wq, wk and wv must each be
their rows of the fused change within 1e-4 of the largest change, every other weight untouched. LyCORIS lora, loha,
lokr, lokr + DoRA (the issue's "DoKR", per output row), glora and ia3 apply; DoRA per input column (its norm runs
over all fused rows) and diag-OFT (it rotates blocks of rows together) are refused by name with that reason.

The same rule on the other families whose diffusers models fuse (both ComfyUIs): Flux (FluxAttention's to_qkv and
to_added_qkv are consecutive rows of ComfyUI's fused qkv / linear1: one patch on those rows) and Wan 2.1 I2V
(WanAttention.fuse_projections' to_qkv, to_kv and to_added_kv on ComfyUI's separate q/k/v, k/v and k_img/v_img,
named by diffusers_names.json), PEFT files saved by the pipelines' save_lora_weights, against PEFT's merge.
"""

import copy
import json

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import comfy.utils
import diffusers
import peft
import pytest
import test_nodes
import torch
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import FUSED_PROJECTIONS
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from reference.lycoris_factory import SEED, Lazy
from test_block_weights import effective_weight
from test_nodes import run_node, weights_after_full_load
from test_peft_dit import adapted, check_node_result, comfy_key, flux, merged_parameters, put  # noqa: F401 (fixture)
from test_video_dit_peft import archs, check_file, lycoris_network  # noqa: F401 (fixture)

needs_krea2 = pytest.mark.skipif(not hasattr(comfy.supported_models, "Krea2"),
                                 reason="Krea 2 exists in ComfyUI 0.33 only (the version matrix)")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths
loras = test_nodes.loras

CPU = torch.device("cpu")
PREFIX = "diffusion_model."
STRENGTHS = (1.0, 0.5)
TOLERANCE = 1e-4  # of the largest change of each weight
# features 64 with 4 heads of 16 and 2 kv heads: q 64 rows, k and v 32 each (GQA); text 40 wide, 4 heads, no GQA
COMFY_CONFIG = {"image_model": "krea2", "features": 64, "heads": 4, "kvheads": 2, "layers": 1, "tdim": 32,
                "txtdim": 40, "txtheads": 4, "txtkvheads": 4, "txtlayers": 2, "channels": 4, "patch": 2,
                "multiplier": 2}
TWIN_CONFIG = {"in_channels": 16, "num_layers": 1, "attention_head_dim": 16, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "timestep_embed_dim": 32, "text_hidden_dim": 40,
               "num_text_layers": 2, "text_num_attention_heads": 4, "text_num_key_value_heads": 4,
               "text_intermediate_size": 128, "axes_dims_rope": (4, 6, 6)}
ATTENTIONS = ["transformer_blocks.0.attn", "text_fusion.layerwise_blocks.0.attn", "text_fusion.layerwise_blocks.1.attn",
              "text_fusion.refiner_blocks.0.attn", "text_fusion.refiner_blocks.1.attn"]
TARGETS = ["to_qkv", "to_out.0"]  # SimpleTuner's Krea2.FUSED_LORA_TARGET
RANK = 4


class Krea2:
    """ComfyUI's tiny Krea 2 in a ModelPatcher, and diffusers' twin holding its attention weights, fused."""

    def __init__(self):
        model_config = comfy.supported_models.Krea2(dict(COMFY_CONFIG))
        model_config.set_inference_dtype(torch.float32, None)
        model = model_config.get_model({}, "", device=CPU)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():  # ComfyUI's layers are not initialised: random weights, about unit gain
            for param in model.diffusion_model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * (param[0].numel() if param.ndim > 1 else 4) ** -.5)
        self.patcher = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # diffusers name -> ComfyUI key, by ComfyUI's own map
        self.to_comfy = comfy.utils.krea2_to_diffusers(model.model_config.unet_config, output_prefix=PREFIX)
        twin = diffusers.Krea2Transformer2DModel(**TWIN_CONFIG).float().eval().requires_grad_(False)
        copied = set()
        with torch.no_grad():
            for name, param in twin.named_parameters():
                if name in self.to_comfy and self.state[self.to_comfy[name]].shape == param.shape:
                    param.copy_(self.state[self.to_comfy[name]])
                    copied.add(name)
        assert {f"{a}.{p}.weight" for a in ATTENTIONS for p in ("to_q", "to_k", "to_v", "to_out.0")} <= copied
        twin.fuse_qkv_projections()
        self.twin = twin

    def rows(self, attention: str) -> dict[str, tuple[int, int]]:
        """ComfyUI key of each projection -> (first row, rows) in the attention's fused to_qkv."""
        parts, start = {}, 0
        for p in ("to_q", "to_k", "to_v"):
            key = self.to_comfy[f"{attention}.{p}.weight"]
            parts[key] = (start, self.state[key].shape[0])
            start += self.state[key].shape[0]
        return parts

    def truth(self, merged: dict) -> dict[str, torch.Tensor]:
        """ComfyUI key -> its full-strength change (float64), to_qkv's split by the projections' rows."""
        changes = {}
        for name, (before, after) in merged.items():
            layer = name.removesuffix(".weight")
            if layer.endswith(".to_qkv"):
                for key, (start, count) in self.rows(layer.removesuffix(".to_qkv")).items():
                    changes[key] = (after - before).narrow(0, start, count)
            else:
                changes[self.to_comfy[name]] = after - before
        return changes


@pytest.fixture(scope="module")
def krea2():
    yield Krea2()
    comfy.model_management.unload_all_models()


@needs_krea2
def test_the_twin_fuses_q_k_v_by_rows_with_gqa_sizes(krea2):
    """diffusers' fuse: to_qkv is [to_q; to_k; to_v] by rows, k and v smaller than q in the image blocks."""
    for attention in ATTENTIONS:
        attn = krea2.twin.get_submodule(attention)
        assert torch.equal(attn.to_qkv.weight, torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
    assert [count for _, count in krea2.rows(ATTENTIONS[0]).values()] == [64, 32, 32]


# --- files ---------------------------------------------------------------------------------------------------------

PEFT_ADAPTERS = {
    "lora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS),
    "dora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, use_dora=True, target_modules=TARGETS),
}
# create_lycoris settings; "dokr" is the issue's LoKr + DoRA (LyCORIS' default wd_on_out: per output row), lokr as
# SimpleTuner's default lycoris_config (linear_dim 10000: full factors, factor 16)
LYCORIS = {
    "lora": {"algo": "lora", "linear_dim": RANK, "linear_alpha": 2.0},
    "loha": {"algo": "loha", "linear_dim": RANK, "linear_alpha": 2.0},
    "lokr": {"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1.0, "factor": 16},
    "dokr": {"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1.0, "factor": 16, "dora_wd": True},
    "dokr-in": {"algo": "lokr", "linear_dim": 10000, "linear_alpha": 1.0, "factor": 16, "dora_wd": True,
                "wd_on_output": False},
    "glora": {"algo": "glora", "linear_dim": RANK, "linear_alpha": 2.0},
    "ia3": {"algo": "ia3"},
    "diag-oft": {"algo": "diag-oft", "linear_dim": 8},
}
REFUSED = {"dokr-in", "diag-oft"}  # files for the refusal test: no truth needed (lycoris' float64 OFT forward fails)


def peft_file(krea2: Krea2, kind: str, folder):
    """Saved as SimpleTuner's _save_lora does: the pipeline's save_lora_weights with PEFT's state dict and config."""
    config = PEFT_ADAPTERS[kind]
    model = adapted(krea2.twin, config, "save_lora_weights", seed=SEED + sum(map(ord, kind)))
    name = f"peft-{kind}.safetensors"
    diffusers.Krea2Pipeline.save_lora_weights(str(folder), transformer_lora_layers=peft.get_peft_model_state_dict(model),
                                              weight_name=name, transformer_lora_adapter_metadata=config.to_dict())
    return {name: (folder / name).read_bytes()}, merged_parameters(model)


@torch.no_grad()
def saved_lycoris(twin, config: dict, layers: list[str], path, seed: int, truth: bool = True):
    """create_lycoris over a float64 copy of `twin`, saved to `path` as SimpleTuner's _save_lycoris does: its module
    names, and each listed layer's (weight before, forward on the identity after) as the truth ({} without truth)."""
    twin = copy.deepcopy(twin).double()
    net = lycoris_network(twin, config, seed)
    modules = {name: twin.get_submodule(name) for name in layers}
    before = {name: module.weight.detach().clone() for name, module in modules.items()}
    net.apply_to()
    net.save_weights(str(path), torch.float32, {"lycoris_config": json.dumps(config)})
    merged = {f"{name}.weight": (before[name], module(torch.eye(module.in_features, dtype=torch.float64)).T)
              for name, module in modules.items() if truth}
    return {lora.lora_name for lora in net.loras}, merged


def lycoris_file(krea2: Krea2, kind: str, folder):
    """create_lycoris over every Linear of each Krea2Attention (to_q/to_k/to_v kept beside to_qkv, to_gate, to_out.0),
    saved as SimpleTuner's _save_lycoris does. Every module gets seeded factors, the unfused copies too: applied,
    they would change wq/wk/wv, so the check sees they are not. Truth: the other layers' forward on the identity."""
    config = {"multiplier": 1.0, **LYCORIS[kind], "apply_preset": {"target_module": ["Krea2Attention"]}}
    layers = [f"{a}.{t}" for a in ATTENTIONS for t in TARGETS + ["to_gate"]]
    path = folder / f"lycoris-{kind}.safetensors"
    names, merged = saved_lycoris(krea2.twin, config, layers, path, SEED + sum(map(ord, kind)), kind not in REFUSED)
    assert "lycoris_transformer_blocks_0_attn_to_qkv" in names and "lycoris_transformer_blocks_0_attn_to_q" in names
    return {path.name: path.read_bytes()}, merged


@pytest.fixture(scope="module")
def files(krea2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused_split")

    def make(case):
        source, kind = case
        sub = folder / f"{source}-{kind}"
        sub.mkdir()
        return (peft_file if source == "peft" else lycoris_file)(krea2, kind, sub)

    return Lazy(make)


# --- the checks ----------------------------------------------------------------------------------------------------

def bypassed_weights(patched, keys: list[str]) -> dict[str, torch.Tensor]:
    """The weight each layer's forward uses with the injections installed (its response to unit inputs)."""
    patched.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        return {k: effective_weight(comfy.utils.get_attr(patched.model, k.removesuffix(".weight"))) for k in keys}
    finally:
        patched.unpatch_model(CPU)


def check_node(krea2: Krea2, name: str, changes: dict[str, torch.Tensor], apply_mode: str, within=".attn.") -> None:
    """Our loader node at each strength: each changed weight is W + m·ΔW (its rows of a fused ΔW), the other weights
    of the layers `within` names as they were."""
    keys = sorted(k for k in krea2.state if k.endswith(".weight") and within in k)
    assert set(changes) <= set(keys)
    for strength in STRENGTHS:
        patched = run_node(LycorisLoaderModelOnly, model=krea2.patcher, lycoris_name=name, strength_model=strength,
                           apply_mode=apply_mode)[0]
        comfy.model_management.unload_all_models()
        got = (weights_after_full_load(patched, keys) if apply_mode == "merge" else bypassed_weights(patched, keys))
        for key in keys:
            base = krea2.state[key].double()
            if key not in changes:
                assert (got[key].double() - base).abs().max() <= 1e-6 * base.abs().max(), f"{key} changed"
                continue
            change = strength * changes[key]
            assert change.abs().max() > 0, key
            error = (got[key].double() - (base + change)).abs().max()
            assert error <= TOLERANCE * change.abs().max(), f"{key} @ {strength} {apply_mode}: {error:.3g}"
    comfy.model_management.unload_all_models()


LABELS = {"lora": "LoRA", "dora": "LoRA+DoRA", "loha": "LoHa", "lokr": "LoKr", "glora": "GLoRA", "ia3": "(IA)³"}
CASES = [("peft", "lora"), ("peft", "dora"), ("lycoris", "lora"), ("lycoris", "loha"), ("lycoris", "lokr"),
         ("lycoris", "dokr"), ("lycoris", "glora"), ("lycoris", "ia3")]


@needs_krea2
@pytest.mark.parametrize("source,kind", CASES)
def test_fused_file_applies_every_module_to_its_rows_of_q_k_v(source, kind, krea2, files, loras):
    written, merged = files[source, kind]
    name = put(loras, written)
    _, report = map_file(read(loras / name), krea2.patcher, None, reference=False)
    assert report.problems == [], report.details()
    assert len(report.applied) == report.total == len(merged)  # a fused module counted once, applied on 3 weights
    fused = [key for key in report.applied if "to_qkv" in key]
    assert len(fused) == len(ATTENTIONS) and all(report.applied[key].count(" + ") == 2 for key in fused)
    assert set(report.labels) == {"LoKr+DoRA" if kind == "dokr" else LABELS[kind]}
    # the unfused copies LyCORIS wrapped beside to_qkv are named, not applied
    superseded = [key for key, reason in report.unused_keys if "fused module" in reason]
    assert len(superseded) == (3 * len(ATTENTIONS) if source == "lycoris" else 0), report.unused_keys
    changes = krea2.truth(merged)
    for apply_mode in ("merge", "bypass"):
        check_node(krea2, name, changes, apply_mode)


@needs_krea2
@pytest.mark.parametrize("kind,reason", [("dokr-in", "input axis"), ("diag-oft", "no split by output rows")])
def test_what_does_not_split_by_rows_is_refused_naming_why(kind, reason, krea2, files, loras):
    """Per input column, DoRA's norm runs over all of q, k and v's rows; diag-OFT rotates blocks of rows together:
    on separate weights both are refused, by name, and the rest of the file applies."""
    written, _ = files["lycoris", kind]
    name = put(loras, written)
    _, report = map_file(read(loras / name), krea2.patcher, None, reference=False)
    refused = dict(report.problems)
    assert sorted(refused) == sorted(f"lycoris_{a.replace('.', '_')}_to_qkv.weight" for a in ATTENTIONS)
    assert all(reason in why and "separate weights" in why for why in refused.values()), refused
    assert len(report.applied) == 2 * len(ATTENTIONS)  # to_out.0, to_gate: whole weights, applied as ever


# --- Flux: the fused projections are consecutive rows of one ComfyUI weight ----------------------------------------

FLUX_FUSED = {"lora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False,
                                      target_modules=["to_qkv", "to_added_qkv"]),
              "dora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, use_dora=True,
                                      target_modules=["to_qkv", "to_added_qkv"])}


@pytest.mark.parametrize("kind", FLUX_FUSED)
def test_flux_fused_projections_land_on_comfy_fused_rows(kind, flux, loras, tmp_path):  # noqa: F811
    """diffusers' Flux after fuse_qkv_projections (FluxAttention: to_qkv, and to_added_qkv in the double blocks),
    saved by FluxPipeline.save_lora_weights: each fused module is one patch on the rows its projections are in
    ComfyUI's qkv (the whole weight) or linear1 (its first 3·h rows), equal to PEFT's merge."""
    patcher, twin, to_comfy = flux
    fused = copy.deepcopy(twin)
    fused.fuse_qkv_projections()
    config = FLUX_FUSED[kind]
    model = adapted(fused, config, "save_lora_weights", seed=SEED + sum(map(ord, kind)))
    diffusers.FluxPipeline.save_lora_weights(str(tmp_path), transformer_lora_layers=peft.get_peft_model_state_dict(model),
                                             weight_name="fused.safetensors",
                                             transformer_lora_adapter_metadata=config.to_dict())
    merged = merged_parameters(model)
    targets = dict(to_comfy)
    for name in merged:  # a fused weight: its projections' consecutive rows of one ComfyUI weight
        stem, fused_name = name.removesuffix(".weight").rsplit(".", 1)
        parts = [to_comfy[f"{stem}.{p}.weight"] for p in FUSED_PROJECTIONS[fused_name]]
        assert len({comfy_key(p) for p in parts}) == 1
        targets[name] = (comfy_key(parts[0]), (0, parts[0][1][1], sum(p[1][2] for p in parts)))
    name = put(loras, {"fused.safetensors": (tmp_path / "fused.safetensors").read_bytes()})
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == [] and len(report.applied) == report.total == len(merged)
    assert any("to_added_qkv" in key for key in report.applied) and any("single" in key for key in report.applied)
    check_node_result(patcher, name, merged, targets)


# --- Wan: separate q/k/v in ComfyUI, diffusers' names derived (diffusers_names.json) ------------------------------

@pytest.mark.parametrize("arch_id", ["wan21-i2v"])
def test_wan_fused_self_cross_and_image_projections_split_onto_q_k_v(arch_id, archs, loras, tmp_path):  # noqa: F811
    """WanAttention.fuse_projections: to_qkv (self-attention), to_kv (text cross-attention) and to_added_kv (I2V's
    image cross-attention) on ComfyUI's separate self_attn.q/k/v, cross_attn.k/v and k_img/v_img, through the
    diffusers names the converter gives; PEFT LoRA saved by WanPipeline.save_lora_weights, against PEFT's merge."""
    models = archs[arch_id]
    fused = copy.deepcopy(models.twin)
    fused.fuse_qkv_projections()
    config = peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False,
                             target_modules=["to_qkv", "to_kv", "to_added_kv"])
    model = adapted(fused, config, "save_lora_weights", seed=SEED)
    diffusers.WanPipeline.save_lora_weights(str(tmp_path), transformer_lora_layers=peft.get_peft_model_state_dict(model),
                                            weight_name="wan-fused.safetensors",
                                            transformer_lora_adapter_metadata=config.to_dict())
    merged = {}
    for name, (before, after) in merged_parameters(model).items():
        stem, fused_name = name.removesuffix(".weight").rsplit(".", 1)
        start = 0
        for part in FUSED_PROJECTIONS[fused_name]:
            rows = models.base[f"{stem}.{part}.weight"].shape[0]
            merged[f"{stem}.{part}.weight"] = (before.narrow(0, start, rows), after.narrow(0, start, rows))
            start += rows
        assert start == before.shape[0], name
    assert {n.rsplit(".", 2)[-2] for n in merged} == {"to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"}
    check_file(models, loras, {"wan-fused.safetensors": (tmp_path / "wan-fused.safetensors").read_bytes()}, merged)
