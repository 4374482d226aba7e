"""PEFT adapters on an nn.Embedding (issue #10): a LoRA (`lora_embedding_A`/`lora_embedding_B`) and an OFT
(`oft_embedding_R`) on CLIP's `token_embedding`, in a file that also holds the same adapter on the attention's
`q_proj`. Written by diffusers' `save_lora_weights` and PEFT's `save_pretrained`, applied through the LycorisLoader
node; the truth is PEFT's own merge() of each layer, in float64. ComfyUI keeps this CLIP in fp16, so the patched
weight must be that truth rounded."""

import copy

import comfy.model_management
import pytest
import test_nodes
import torch
from diffusers import StableDiffusionPipeline
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from patcher_util import assert_rounded_from
from peft import LoraConfig, OFTConfig, get_peft_model, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from test_nodes import run_node, weights_after_full_load
from test_peft_diffusers_names import comfy_clip_key
from transformers import CLIPTextConfig, CLIPTextModel

sd15 = test_nodes.sd15
loras = test_nodes.loras

TARGETS = ["token_embedding", "q_proj"]
EMBEDDING = "clip_l.transformer.text_model.embeddings.token_embedding.weight"
CASES = {
    # no config in the file: alpha = r, as diffusers assumes
    "lora-save_lora_weights": ("save_lora_weights", LoraConfig(
        r=4, lora_alpha=4, init_lora_weights=False, target_modules=TARGETS)),
    # the embedding's own rank and alpha from the patterns, rsLoRA's alpha/√r: all from the config diffusers stores
    "lora-patterns-rslora-save_lora_weights+metadata": ("save_lora_weights+metadata", LoraConfig(
        r=4, lora_alpha=8, rank_pattern={"token_embedding": 2}, alpha_pattern={"token_embedding": 6},
        use_rslora=True, init_lora_weights=False, target_modules=TARGETS)),
    # alpha ≠ r from adapter_config.json beside the weights
    "lora-alpha-save_pretrained": ("save_pretrained", LoraConfig(
        r=4, lora_alpha=12, init_lora_weights=False, target_modules=TARGETS)),
    "oft-save_pretrained": ("save_pretrained", OFTConfig(
        r=0, oft_block_size=32, init_weights=False, target_modules=TARGETS)),
    # one shared block, exact Cayley and COFT, told by the config diffusers stores
    "oft-options-save_lora_weights+metadata": ("save_lora_weights+metadata", OFTConfig(
        r=0, oft_block_size=64, block_share=True, use_cayley_neumann=False, coft=True, eps=0.5,
        init_weights=False, target_modules=TARGETS)),
}


@pytest.fixture(scope="module")
def clip_weights(sd15):
    """The tiny SD1.5 CLIP-L weights under transformers' names."""
    _model, clip = sd15
    csd = clip.cond_stage_model.state_dict()
    names = CLIPTextModel(text_config()).state_dict()
    return {k: csd[comfy_clip_key(k)].float() for k in names}


def text_config() -> CLIPTextConfig:
    return CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)


def merged_layers(model) -> dict[str, torch.Tensor]:
    """transformers weight name -> PEFT's merge() of the adapter into that layer alone, in float64."""
    merged = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            layer = copy.deepcopy(module).double()
            layer.merge()
            merged[name.removeprefix("base_model.model.") + ".weight"] = layer.get_base_layer().weight.detach()
    return merged


def assert_rounded(got: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """assert_rounded_from, asked only about the elements that are not the nearest rounding of the truth (the others
    pass it): the same check at a fraction of its cost on a 49408×768 table."""
    off = got != truth.to(got.dtype)
    if off.any():
        assert_rounded_from(got[off], truth[off], got.dtype, what=what)


def save(config, save_format: str, weights: dict, loras) -> tuple[str, dict[str, torch.Tensor]]:
    """The adapter written by its own saver into the loras folder: (name for the node, merged weights by ComfyUI key)."""
    text_model = CLIPTextModel(text_config())
    text_model.load_state_dict(weights, strict=True)
    torch.manual_seed(11)
    if save_format == "save_pretrained":
        wrapped = get_peft_model(text_model, config)
    else:
        wrapped = inject_adapter_in_model(config, text_model)
    with torch.no_grad():  # a trained LoRA's size: a change of about the weight's own, not 100 times it
        for key, parameter in wrapped.named_parameters():
            if "lora_embedding_" in key:
                parameter.mul_(0.1)
    if save_format == "save_pretrained":
        wrapped.save_pretrained(str(loras / "te-peft"))
        name = "te-peft/adapter_model.safetensors"  # its adapter_config.json beside it
    else:
        metadata = config.to_dict() if save_format.endswith("+metadata") else None
        name = "te.safetensors"
        StableDiffusionPipeline.save_lora_weights(str(loras), text_encoder_lora_layers=get_peft_model_state_dict(
            wrapped), text_encoder_lora_adapter_metadata=metadata, weight_name=name)
    return name, {comfy_clip_key(n): w for n, w in merged_layers(wrapped).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_on_the_token_embedding_applies_as_peft_merges_it(case, clip_weights, sd15, loras):
    model, clip = sd15
    save_format, config = CASES[case]
    name, merged = save(config, save_format, clip_weights, loras)
    assert EMBEDDING in merged and len(merged) == 13  # the embedding and 12 q_proj
    original = clip.cond_stage_model.state_dict()[EMBEDDING].double()
    assert (merged[EMBEDDING] - original).abs().max() > 1e-3  # the adapter changes it

    lfile = read(loras / name)
    _, report = map_file(lfile, None, clip, reference=False)
    assert report.problems == [] and report.unused_keys == []
    assert sorted(report.applied.values()) == sorted(merged)
    if case.startswith("lora"):  # the inspector's alpha and the 'alpha = rank assumed' flag, as for the q_proj LoRA
        embedding = next(m for m in lfile.modules.values() if "token_embedding" in m.prefix)
        q_proj = next(m for m in lfile.modules.values() if "q_proj" in m.prefix)
        assumed = case == "lora-save_lora_weights"  # no config anywhere
        assert embedding.scale_assumed == q_proj.scale_assumed == assumed
        assert (embedding.alpha is None) == (q_proj.alpha is None) == assumed

    _m, patched = run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.0,
                           strength_clip=1.0)
    comfy.model_management.unload_all_models()  # a CLIP ComfyUI loaded earlier counts its weights as patched
    got = weights_after_full_load(patched.patcher, list(merged))
    for key, truth in merged.items():  # ComfyUI keeps this CLIP in fp16: the patched weight is the truth rounded
        assert_rounded(got[key], truth, what=key)


def test_embedding_adapters_that_do_not_fit_are_refused_naming_file_and_key():
    """Factors that disagree are refused when the file is read; a rotation or table of another size than the model's
    embedding when it is planned. Each error names the file and the key at fault."""
    from lycoris_nodes.lycoris_core import LycorisError, parse_state_dict

    prefix = "text_encoder.text_model.embeddings.token_embedding"
    with pytest.raises(LycorisError, match=rf"bad: {prefix}\.lora_embedding_A: .*does not match"):
        parse_state_dict({f"{prefix}.lora_embedding_A": torch.zeros(4, 100),
                          f"{prefix}.lora_embedding_B": torch.zeros(16, 3)}, "bad")
    lora = parse_state_dict({f"{prefix}.lora_embedding_A": torch.zeros(4, 100),
                             f"{prefix}.lora_embedding_B": torch.zeros(16, 4)}, "lora").modules[prefix + ".weight"]
    assert lora.plan_for((100, 16)).layout.rank == 4
    with pytest.raises(LycorisError, match=rf"lora: {prefix}: module is for a weight of shape \[100, 16\]"):
        lora.plan_for((99, 16), file="lora")
    oft = parse_state_dict({f"{prefix}.oft_embedding_R.weight": torch.zeros(2, 28)}, "oft").modules[prefix + ".weight"]
    assert oft.plan_for((100, 16)).layout.blocks == 2  # two blocks of 8 across the 16 columns
    with pytest.raises(LycorisError, match=rf"oft: {prefix}\.oft_embedding_R\.weight: OFT rotates 2 blocks of 8"):
        oft.plan_for((100, 24), file="oft")


def test_peft_dora_on_an_embedding_is_refused_naming_file_and_key(tmp_path):
    """PEFT's DoRA on an Embedding (its magnitude per column of the table) is refused when the file is loaded, with
    the reason, rather than applied as the LoRA alone; the same file's Linear DoRA alone would load."""
    from lycoris_nodes.lycoris_core import LycorisError, load

    model = torch.nn.Module()
    model.token_embedding, model.q_proj = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16)
    config = LoraConfig(r=4, lora_alpha=4, use_dora=True, init_lora_weights=False, target_modules=TARGETS)
    get_peft_model(model, config).save_pretrained(str(tmp_path))
    path = tmp_path / "adapter_model.safetensors"
    with pytest.raises(LycorisError, match=r"adapter_model\.safetensors: base_model\.model\.token_embedding\."
                                           r"lora_magnitude_vector: PEFT's DoRA on an embedding"):
        load(path)


@pytest.mark.parametrize("strength", [1.0, 0.5, -0.5])
@pytest.mark.parametrize("config", [
    LoraConfig(r=4, lora_alpha=6, init_lora_weights=False, target_modules=TARGETS),
    OFTConfig(r=0, oft_block_size=8, init_weights=False, target_modules=TARGETS),
], ids=["lora", "oft"])
def test_embedding_adapter_at_any_strength_is_the_linear_share_of_peft_merge(config, strength, tmp_path):
    """Computed in float64 (no rounding), the patched table at strength m is W + m·(PEFT's merge − W), as for PEFT's other
    adapters (PEFT defines no strength of its own)."""
    from lycoris_nodes.lycoris_core import apply, load

    torch.manual_seed(5)
    model = torch.nn.Module()
    model.token_embedding, model.q_proj = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16)
    wrapped = get_peft_model(model, config)
    wrapped.save_pretrained(str(tmp_path))
    lfile = load(tmp_path / "adapter_model.safetensors")
    assert not lfile.unused and len(lfile.modules) == 2
    for name, merged in merged_layers(wrapped).items():
        weight = wrapped.get_submodule(name.removesuffix(".weight")).get_base_layer().weight.detach().double()
        module = lfile.modules["base_model.model." + name]
        patched = apply(module.plan_for(tuple(weight.shape)), module.tensors, weight.clone(), strength,
                        intermediate_dtype=torch.float64)
        torch.testing.assert_close(patched, weight + strength * (merged - weight), rtol=0, atol=1e-12)
