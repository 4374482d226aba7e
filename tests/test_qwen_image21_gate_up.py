"""Qwen-Image 2.1's fused SwiGLU weight, reached by the names trainers give its two halves.

ComfyUI 0.37+ loads Qwen-Image 2.1 (image_model "qwen_image21": Comfy-Org/ComfyUI comfy/model_detection.py at
0b61ce5b; comfy/model_base.py at 094c74c1: `class QwenImage21(QwenImage)`) with each block's SwiGLU gate and up
projections fused into one weight, `transformer_blocks.N.img_mlp.gate_up` = [gate; up] by rows
(comfy/ldm/qwen_image21/model.py SwiGLUFeedForward at 08f68f09). Every trainer keeps diffusers' two Linears
(diffusers 0.42.1 QwenImage21SwiGLUFeedForward: `img_mlp.gate_layer`, `img_mlp.proj`), which ComfyUI's own converter
gives as the gate rows then the up rows (diffusers single_file_utils.py
convert_qwen_image21_transformer_checkpoint_to_diffusers: gate_up.chunk(2)), as ComfyUI 0.38's key map does
(comfy/lora.py model_lora_keys_unet at 17358c8f). Our map gives them from the model's own weights
(keymap.FUSED_WEIGHT_PARTS), so they apply on a 0.37 whose map lacks them.

Neither ComfyUI the tests run has the class (0.38 does not run here), so the model is ComfyUI's own Qwen-Image
(`model_base.QwenImage`, which 2.1's class subclasses, so its key-map branch is the one 0.37 runs for 2.1) at a tiny
width with each block's img_mlp replaced by 2.1's fused layout (a `gate_up` Linear of 2·hidden rows and an `out`
Linear, of ComfyUI's ops) and its unet_config naming the architecture as 0.37+'s detection does. Its twin for the
truth is diffusers' own QwenImage21Transformer2DModel of the same sizes holding the halves of gate_up.
"""

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import diffusers
import peft
import pytest
import test_nodes
import torch
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import COMFY_BUILDERS, extend
from lycoris_nodes.nodes.glue.patch_key import Offset
from reference.lycoris_factory import SEED
from test_fused_split import LYCORIS, check_node, saved_lycoris
from test_peft_dit import adapted, merged_parameters, put
from test_trainer_names import LORA, PEFT, _report

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths
loras = test_nodes.loras

CPU = torch.device("cpu")
DIM, HIDDEN, BLOCKS = 32, 96, 2  # 2 heads of 16; mlp_ratio 3, as Qwen-Image 2.1
COMFY_CONFIG = {"image_model": "qwen_image21", "patch_size": 2, "in_channels": 8, "out_channels": 2,
                "num_layers": BLOCKS, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 16,
                "pooled_projection_dim": 16, "axes_dims_rope": (4, 6, 6)}
TWIN_CONFIG = {"in_channels": 8, "out_channels": 8, "num_layers": BLOCKS, "attention_head_dim": 16,
               "num_attention_heads": 2, "context_in_dim": 16, "mlp_ratio": 3, "axes_dims_rope": (4, 6, 6)}
PARTS = ("gate_layer", "proj")  # diffusers' names of gate_up's halves, in row order


def gate_up(block: int) -> str:
    return f"diffusion_model.transformer_blocks.{block}.img_mlp.gate_up.weight"


class FusedSwiGLU(torch.nn.Module):
    """ComfyUI 0.38's SwiGLUFeedForward(fused=True) weights: [gate; up] in one Linear, then out (bias-free)."""

    def __init__(self, linear):
        super().__init__()
        self.gate_up = linear(DIM, 2 * HIDDEN, bias=False, dtype=torch.float32, device=CPU)
        self.out = linear(HIDDEN, DIM, bias=False, dtype=torch.float32, device=CPU)


class QwenImage21:
    """ComfyUI's tiny Qwen-Image with 2.1's fused img_mlp in a ModelPatcher, and diffusers' 2.1 twin holding the
    halves of each gate_up as its gate_layer and proj."""

    def __init__(self):
        model_config = comfy.supported_models.QwenImage(dict(COMFY_CONFIG))
        model_config.set_inference_dtype(torch.float32, None)
        model = model_config.get_model({}, "", device=CPU)
        for block in model.diffusion_model.transformer_blocks:
            block.img_mlp = FusedSwiGLU(type(block.attn.to_q))  # ComfyUI's own Linear class (its cast path)
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():  # ComfyUI's layers are not initialised: random weights, about unit gain
            for param in model.diffusion_model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * (param[0].numel() if param.ndim > 1 else 4) ** -.5)
        self.model = model
        self.patcher = comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        twin = diffusers.QwenImage21Transformer2DModel(**TWIN_CONFIG).float().eval().requires_grad_(False)
        with torch.no_grad():
            for i, block in enumerate(twin.transformer_blocks):
                block.img_mlp.gate_layer.weight.copy_(self.state[gate_up(i)][:HIDDEN])
                block.img_mlp.proj.weight.copy_(self.state[gate_up(i)][HIDDEN:])
                block.img_mlp.out.weight.copy_(self.state[f"diffusion_model.transformer_blocks.{i}.img_mlp.out.weight"])
        self.twin = twin

    def truth(self, merged: dict) -> dict[str, torch.Tensor]:
        """ComfyUI key -> its change (float64): gate_up's is cat(ΔW_gate_layer, ΔW_proj), out's its own."""
        changes = {}
        for i in range(BLOCKS):
            stem = f"transformer_blocks.{i}.img_mlp."
            halves = [merged[f"{stem}{part}.weight"] for part in PARTS]
            changes[gate_up(i)] = torch.cat([after - before for before, after in halves])
            if f"{stem}out.weight" in merged:
                before, after = merged[f"{stem}out.weight"]
                changes[f"diffusion_model.{stem}out.weight"] = after - before
        return changes


@pytest.fixture(scope="module")
def qwen21():
    yield QwenImage21()
    comfy.model_management.unload_all_models()


# --- names -----------------------------------------------------------------------------------------------------------

# diffusers 0.42.1: QwenImage21Pipeline(QwenImageLoraLoaderMixin).save_lora_weights writes `transformer.` + the module
# path; SimpleTuner's Qwen-Image 2.1 pipeline is that one (bghira/SimpleTuner at e1b115b3,
# simpletuner/helpers/models/qwen_image/pipeline_21.py, transformer_21.py QwenImage21SwiGLUFeedForward), its _save_lora
# calls it (helpers/training/save_hooks.py).
DIFFUSERS = "diffusers QwenImage21Pipeline.save_lora_weights; SimpleTuner pipeline_21.py (_save_lora)"
# SimpleTuner lora_type=lycoris: `lycoris_` + the diffusers path, dots as underscores (save_hooks.py _save_lycoris).
SIMPLETUNER_LYCORIS = "bghira/SimpleTuner helpers/training/save_hooks.py _save_lycoris (lycoris_)"
# PEFT's own savers: get_peft_model_state_dict (no prefix) and PeftModel.save_pretrained (`base_model.model.`).
PEFT_BARE, PEFT_WRAPPED = "peft get_peft_model_state_dict", "peft PeftModel.save_pretrained"
# ai-toolkit's Qwen-Image 2.1 (extensions_built_in/diffusion_models/qwen_image_21/qwen_image_21.py, read in
# speedyrulz/ai-toolkit-pipeline-parallelism at a845b946, a fork of ostris/ai-toolkit): diffusers' vendored model,
# QwenImage21Model.convert_lora_weights_before_save renames `transformer.` to `diffusion_model.`.
AI_TOOLKIT = "ai-toolkit QwenImage21Model.convert_lora_weights_before_save (transformer. -> diffusion_model.)"
# musubi-tuner (kohya-ss/musubi-tuner at 960b2011): networks/lora_qwen_image_21.py, prefix `lora_unet` over
# QwenImage21TransformerBlock, whose SwiGLU keeps gate_layer, proj and out (qwen_image_21/qwen_image_21_model.py);
# networks/lora.py names a module `lora_unet_` + its path, dots as underscores.
MUSUBI = "kohya-ss/musubi-tuner networks/lora_qwen_image_21.py (lora_unet_ + the port's paths)"
# (trainer, name of block 1's part as written, suffixes, source)
NAMES = [
    ("diffusers / SimpleTuner", "transformer.transformer_blocks.1.img_mlp.{}", PEFT, DIFFUSERS),
    ("PEFT", "transformer_blocks.1.img_mlp.{}", PEFT, PEFT_BARE),
    ("PEFT", "base_model.model.transformer_blocks.1.img_mlp.{}", PEFT, PEFT_WRAPPED),
    ("ai-toolkit", "diffusion_model.transformer_blocks.1.img_mlp.{}", PEFT, AI_TOOLKIT),
    ("SimpleTuner", "lycoris_transformer_blocks_1_img_mlp_{}", LORA, SIMPLETUNER_LYCORIS),
    ("musubi-tuner", "lora_unet_transformer_blocks_1_img_mlp_{}", LORA, MUSUBI),
    # OneTrainer's legacy prefix, which our map adds for every DiT (OneTrainer trains no Qwen-Image 2.1)
    ("our prefixes", "lora_transformer_transformer_blocks_1_img_mlp_{}", LORA, "keymap.DIT_UNDERSCORED_PREFIXES"),
]


@pytest.mark.parametrize("part", range(len(PARTS)), ids=PARTS)
@pytest.mark.parametrize("trainer,name,suffixes,source", NAMES, ids=[n[1].split("transformer_blocks")[0] or "bare"
                                                                     for n in NAMES])
def test_each_trainers_halves_land_on_their_rows_of_gate_up(trainer, name, suffixes, source, part, qwen21):
    rows = (0, part * HIDDEN, HIDDEN)
    report = _report("qwen_image21", name.format(PARTS[part]), suffixes, gate_up(1), rows, None,
                     {"qwen_image21": qwen21.model})
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    module_key = next(iter(report.applied))
    assert report.applied == {module_key: gate_up(1)}
    assert report.targets[module_key].target.offset == Offset.from_comfy(rows)


def comfy_038_map(model) -> dict:
    """ComfyUI's map as 0.38 gives it for a Qwen-Image 2.1 model (comfy/lora.py model_lora_keys_unet at 17358c8f, its
    `isinstance(model, QwenImage)` branch): each `…img_mlp.gate_up` listed as its halves under bare, `transformer.`
    and `lycoris_` names instead of whole."""
    comfy_map = COMFY_BUILDERS[False](model, {})
    for i in range(BLOCKS):
        path = gate_up(i).removeprefix("diffusion_model.").removesuffix(".weight")
        for name in (path, "transformer." + path, "lycoris_" + path.replace(".", "_")):
            del comfy_map[name]
        for part, rows in zip(PARTS, ((0, 0, HIDDEN), (0, HIDDEN, HIDDEN))):
            half = path.replace(".gate_up", "." + part)
            for name in (half, "transformer." + half, "lycoris_" + half.replace(".", "_")):
                comfy_map[name] = (gate_up(i), rows)
    return comfy_map


def test_comfyui_038s_own_halves_agree_and_keep_every_prefix(qwen21):
    """On 0.38 ComfyUI's entries for the halves win and ours are the same targets, so none is dropped as a conflict:
    the map is the same whether or not ComfyUI lists them."""
    ours = extend(qwen21.model, COMFY_BUILDERS[False](qwen21.model, {}), False)
    with_038 = extend(qwen21.model, comfy_038_map(qwen21.model), False)
    halves = {name: target for name, target in ours.items() if "gate_layer" in name or "img_mlp_proj" in name
              or "img_mlp.proj" in name}
    assert len(halves) == BLOCKS * len(PARTS) * 7  # 4 dotted prefixes, 2 underscored, musubi's
    assert {name: with_038.get(name) for name in halves} == halves


def test_only_qwen_image21_gets_the_halves(qwen21, monkeypatch):
    """The rule is per architecture: the same weights under another image_model get no gate_layer / proj names."""
    monkeypatch.setitem(qwen21.model.model_config.unet_config, "image_model", "qwen_image")
    names = extend(qwen21.model, COMFY_BUILDERS[False](qwen21.model, {}), False)
    assert not [name for name in names if "gate_layer" in name]
    assert names["transformer.transformer_blocks.0.img_mlp.gate_up"] == gate_up(0)  # the whole weight, as ComfyUI's


# --- values ----------------------------------------------------------------------------------------------------------

RANK = 4
TARGETS = ["img_mlp.gate_layer", "img_mlp.proj"]
ADAPTERS = {
    "lora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, target_modules=TARGETS),
    "dora": peft.LoraConfig(r=RANK, lora_alpha=8, init_lora_weights=False, use_dora=True, target_modules=TARGETS),
}


def check_file(qwen21: QwenImage21, loras, path, merged: dict) -> None:
    """Every module of the file applies; through our loader node, merged and bypassed at strengths 1 and 0.5, each
    changed weight is the truth's (gate_up: its two halves), every other img_mlp weight as it was."""
    name = put(loras, {path.name: path.read_bytes()})
    _, report = map_file(read(loras / name), qwen21.patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == [] and report.warnings == []
    assert len(report.applied) == report.total == len(merged)
    changes = qwen21.truth(merged)
    for apply_mode in ("merge", "bypass"):
        check_node(qwen21, name, changes, apply_mode, within=".img_mlp.")


@pytest.mark.parametrize("kind", ADAPTERS)
def test_peft_file_on_the_halves_equals_peft_merge_on_gate_up(kind, qwen21, loras, tmp_path):
    """A PEFT LoRA / DoRA (per output row, so exact on a row half) on diffusers' separate gate_layer and proj, saved
    by QwenImage21Pipeline.save_lora_weights: each gate_up is W + m·cat(ΔW_gate, ΔW_up) of PEFT's merge."""
    config = ADAPTERS[kind]
    model = adapted(qwen21.twin, config, "save_lora_weights", seed=SEED + sum(map(ord, kind)))
    name = f"qwen21-{kind}.safetensors"
    diffusers.QwenImage21Pipeline.save_lora_weights(
        str(tmp_path), transformer_lora_layers=peft.get_peft_model_state_dict(model), weight_name=name,
        transformer_lora_adapter_metadata=config.to_dict())
    merged = merged_parameters(model)
    assert sorted(merged) == sorted(f"transformer_blocks.{i}.img_mlp.{p}.weight" for i in range(BLOCKS) for p in PARTS)
    check_file(qwen21, loras, tmp_path / name, merged)


@pytest.mark.parametrize("kind", ["lokr", "dokr"])
def test_lycoris_file_on_the_halves_equals_its_forward_on_gate_up(kind, qwen21, loras, tmp_path):
    """create_lycoris as SimpleTuner's lora_type=lycoris saves it (`lycoris_` names), a class preset on diffusers'
    QwenImage21SwiGLUFeedForward: LoKr, and LoKr + DoRA per output row (LyCORIS' default), on gate_layer and proj
    (their halves of gate_up) and out (whole), against the network's forward on the identity."""
    config = {"multiplier": 1.0, **LYCORIS[kind], "apply_preset": {"target_module": ["QwenImage21SwiGLUFeedForward"]}}
    layers = [f"transformer_blocks.{i}.img_mlp.{p}" for i in range(BLOCKS) for p in (*PARTS, "out")]
    path = tmp_path / f"qwen21-lycoris-{kind}.safetensors"
    names, merged = saved_lycoris(qwen21.twin, config, layers, path, SEED + sum(map(ord, kind)))
    assert names == {f"lycoris_{layer.replace('.', '_')}" for layer in layers}
    check_file(qwen21, loras, path, merged)
