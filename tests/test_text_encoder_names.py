"""Text encoders of every family, from every trainer that writes them, through our loader's key map; and the "made
for" verdict of a text-encoder-only file.

Each family's text encoder is ComfyUI's own (the factory comfy/sd.py calls for it: `hunyuan_video_clip`,
`qwen_image.te`, `anima.te`, ...) on the meta device at its released widths, a few layers deep through ComfyUI's own
`<encoder>_model_config` model option; a family the running ComfyUI lacks is skipped (0.3.75 has no Anima, LTX-2,
Krea 2, Flux.2 or ERNIE text encoders). Each row is a one-module file with the exact name one trainer's saver writes
(its source cited at the row), shaped from the ComfyUI weight it is meant for; it must land on that weight.

The language models: ComfyUI ports them as `<encoder>.transformer.model.layers.N…`, where transformers saves them
under its own wrappers (LlamaModel / Qwen3Model `layers.N…`, transformers 5's vision-language models
`model.language_model.layers.N…`); keymap.LM_WRAPPERS. The values test runs a PEFT file (PEFT's save_pretrained over
transformers' Qwen3ForCausalLM) on ComfyUI's Z-Image text encoder holding the same weights, against PEFT's merge().
"""

import copy
import importlib

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.sdxl_clip
import pytest
import torch
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.lycoris_core.families import infer_family
from lycoris_nodes.nodes.glue.apply import build_patches
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.coverage import BY_DESIGN, family_verdict
from lycoris_nodes.nodes.glue.keymap import lora_key_map, model_shapes
from test_nodes import weights_after_full_load
from test_trainer_names import LORA, PEFT, _module

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths

DEPTH = 4  # HunyuanVideo's Llama encodes from layer -3

# family -> (module of comfy.text_encoders, factory comfy/sd.py calls, its keyword arguments, encoders to shorten)
ENCODERS = {
    "hunyuan_video": ("hunyuan_video", "hunyuan_video_clip", {}, ("llama", "clip_l")),
    "hidream": ("hidream", "hidream_clip", {}, ("llama", "clip_l", "clip_g")),
    "qwen_image": ("qwen_image", "te", {}, ("qwen25_7b",)),
    "anima": ("anima", "te", {}, ("qwen3_06b",)),
    "lumina2": ("lumina2", "te", {}, ("gemma2_2b",)),
    "z_image": ("z_image", "te", {}, ("qwen3_4b",)),
    "ltx2": ("lt", "ltxav_te", {}, ("gemma3_12b",)),
    "krea2": ("krea2", "te", {}, ("qwen3vl_4b",)),
    "flux2": ("flux", "flux2_te", {}, ("mistral3_24b",)),
    "sd3": ("sd3_clip", "sd3_clip", {}, ("clip_l", "clip_g")),
    "joyimage": ("joyimage", "te", {}, ("qwen3vl_8b",)),  # a language model ComfyUI builds with its lm_head
}

# Sources, as read (repository snapshots named once):
# OneTrainer at 23df3832: modules/model/<Model>.py lora_text_encoders() declares each encoder's name per format
# (DIFFUSERS_LORA text_encoder[_N], KOHYA_LORA lora_te[N], COMFY_LORA text_encoders.<ComfyUI root>);
# modules/modelSetup/<Model>LoRASetup.py wraps every Linear of the transformers model (transformers 5.5.4,
# requirements-global.txt) as `<name>.<module path>`; modules/modelSaver/mixin/LoRASaverMixin.py writes LEGACY
# (the model's _convert_legacy), KOHYA (lora_kohya_conversion + kohya_flatten), DIFFUSERS (convert_to_diffusers:
# lora_A/lora_B, alpha folded) and COMFY (text_encoders.<root> + the canonical path, lora_A/lora_B + alpha).
OT_HV = ("Nerogar/OneTrainer HunyuanVideoModel.lora_text_encoders (text_encoder = LlamaModel: lora_te1; text_encoder_2 "
         "= CLIPTextModel: lora_te2); HunyuanVideoLoRASaver LEGACY = convert_to_mixture")
OT_HIDREAM = ("Nerogar/OneTrainer HiDreamModel.lora_text_encoders (text_encoder_4 = LlamaForCausalLM: lora_te4, "
              "text_encoders.llama.transformer)")
OT_QWEN = ("Nerogar/OneTrainer QwenModel.lora_text_encoders (text_encoder = Qwen2_5_VLForConditionalGeneration: "
           "lora_te, text_encoders.qwen25_7b.transformer); QwenLoRASaver LEGACY = the canonical dict")
OT_SD3 = "Nerogar/OneTrainer StableDiffusion3Model.lora_text_encoders (clip_l, clip_g, t5xxl: lora_te1/2/3)"
# kohya-ss/sd-scripts at 48d368fa: networks/lora_anima.py (LORA_PREFIX_TEXT_ENCODER = "lora_te" over
# library/anima_utils.py's Qwen3ForCausalLM(...).model, a Qwen3Model), networks/convert_anima_lora_to_comfy.py
# (COMFYUI_QWEN3_PREFIX = "text_encoders.qwen3_06b.transformer.model."), networks/lora_lumina.py ("lora_te" over
# library/lumina_train_util.py's Gemma2Model).
SD_SCRIPTS_ANIMA = "kohya-ss/sd-scripts networks/lora_anima.py (lora_te_ + Qwen3Model paths)"
SD_SCRIPTS_ANIMA_COMFY = "kohya-ss/sd-scripts networks/convert_anima_lora_to_comfy.py (COMFYUI_QWEN3_PREFIX)"
SD_SCRIPTS_LUMINA = "kohya-ss/sd-scripts networks/lora_lumina.py (lora_te_ + Gemma2Model paths)"
# PEFT's save_pretrained over transformers' own model (base_model.model. + its module path), transformers 5 classes:
PEFT_GEMMA3 = "PEFT save_pretrained over transformers 5 Gemma3ForConditionalGeneration (model.language_model.)"
PEFT_QWEN3VL = "PEFT save_pretrained over transformers 5 Qwen3VLForConditionalGeneration (model.language_model.)"
PEFT_MISTRAL3 = "PEFT save_pretrained over transformers 5 Mistral3ForConditionalGeneration (model.language_model.)"
PEFT_QWEN3 = "PEFT save_pretrained over transformers Qwen3ForCausalLM (model.layers.)"
# ComfyUI's own names (comfy/lora.py model_lora_keys_clip): `text_encoders.<key>`, and `text_encoders.<key from
# .transformer.>` for a wrapped encoder (Comfy-Org/ComfyUI #12852, for LTX-2's Gemma LoRA in LTX 2.3's workflows).
COMFY_OWN = "Comfy-Org/ComfyUI comfy/lora.py model_lora_keys_clip (text_encoders.<key>)"

LLAMA, CLIP_L = "llama.transformer.model.layers.0.", "clip_l.transformer.text_model.encoder.layers.0."
QWEN25, QWEN3_06, GEMMA2 = ("qwen25_7b.transformer.model.layers.0.", "qwen3_06b.transformer.model.layers.0.",
                            "gemma2_2b.transformer.model.layers.0.")
GEMMA3, QWEN3VL, MISTRAL = ("gemma3_12b.transformer.model.layers.0.", "qwen3vl_4b.transformer.model.layers.0.",
                            "mistral3_24b.transformer.model.layers.0.")

# (family, trainer, module name as written, suffixes, target weight, source)
NAMES = [
    # HunyuanVideo: Llama (text_encoder, lora_te1) and CLIP-L (text_encoder_2, lora_te2), in every OneTrainer format
    ("hunyuan_video", "OneTrainer LEGACY/KOHYA", "lora_te1_layers_0_self_attn_q_proj", LORA,
     LLAMA + "self_attn.q_proj.weight", OT_HV),
    ("hunyuan_video", "OneTrainer LEGACY/KOHYA", "lora_te1_layers_0_mlp_down_proj", LORA,
     LLAMA + "mlp.down_proj.weight", OT_HV),
    ("hunyuan_video", "OneTrainer LEGACY/KOHYA", "lora_te2_text_model_encoder_layers_0_self_attn_q_proj", LORA,
     CLIP_L + "self_attn.q_proj.weight", OT_HV),
    ("hunyuan_video", "OneTrainer DIFFUSERS", "text_encoder.layers.0.self_attn.v_proj", PEFT,
     LLAMA + "self_attn.v_proj.weight", OT_HV),
    ("hunyuan_video", "OneTrainer DIFFUSERS", "text_encoder_2.text_model.encoder.layers.0.mlp.fc1", PEFT,
     CLIP_L + "mlp.fc1.weight", OT_HV),
    ("hunyuan_video", "OneTrainer COMFY", "text_encoders.llama.transformer.layers.0.mlp.gate_proj", PEFT,
     LLAMA + "mlp.gate_proj.weight", OT_HV),
    ("hunyuan_video", "OneTrainer COMFY", "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.k_proj",
     PEFT, CLIP_L + "self_attn.k_proj.weight", OT_HV),
    # HiDream: Llama 3.1 as a causal LM, the fourth encoder
    ("hidream", "OneTrainer KOHYA", "lora_te4_model_layers_0_self_attn_o_proj", LORA, LLAMA + "self_attn.o_proj.weight",
     OT_HIDREAM),
    ("hidream", "OneTrainer DIFFUSERS", "text_encoder_4.model.layers.0.mlp.up_proj", PEFT, LLAMA + "mlp.up_proj.weight",
     OT_HIDREAM),
    ("hidream", "OneTrainer COMFY", "text_encoders.llama.transformer.model.layers.0.self_attn.k_proj", PEFT,
     LLAMA + "self_attn.k_proj.weight", OT_HIDREAM),
    # Qwen-Image: transformers 5's Qwen2.5-VL, `model.language_model.` and `model.visual.`
    ("qwen_image", "OneTrainer LEGACY", "text_encoder.model.language_model.layers.0.self_attn.q_proj", LORA,
     QWEN25 + "self_attn.q_proj.weight", OT_QWEN),
    ("qwen_image", "OneTrainer KOHYA", "lora_te_model_language_model_layers_0_mlp_gate_proj", LORA,
     QWEN25 + "mlp.gate_proj.weight", OT_QWEN),
    ("qwen_image", "OneTrainer DIFFUSERS", "text_encoder.model.language_model.layers.0.mlp.down_proj", PEFT,
     QWEN25 + "mlp.down_proj.weight", OT_QWEN),
    ("qwen_image", "OneTrainer COMFY", "text_encoders.qwen25_7b.transformer.model.language_model.layers.0.self_attn.o_proj",
     PEFT, QWEN25 + "self_attn.o_proj.weight", OT_QWEN),
    ("qwen_image", "OneTrainer LEGACY", "text_encoder.model.visual.blocks.0.attn.qkv", LORA,
     "qwen25_7b.transformer.visual.blocks.0.attn.qkv.weight", OT_QWEN),
    # Anima, Lumina 2: sd-scripts' lora_te_ over the base model (ComfyUI 0.33 maps it for a single-LLM encoder)
    ("anima", "sd-scripts", "lora_te_layers_0_self_attn_q_proj", LORA, QWEN3_06 + "self_attn.q_proj.weight",
     SD_SCRIPTS_ANIMA),
    ("anima", "sd-scripts (ComfyUI format)", "text_encoders.qwen3_06b.transformer.model.layers.0.mlp.down_proj", PEFT,
     QWEN3_06 + "mlp.down_proj.weight", SD_SCRIPTS_ANIMA_COMFY),
    ("lumina2", "sd-scripts", "lora_te_layers_0_mlp_up_proj", LORA, GEMMA2 + "mlp.up_proj.weight", SD_SCRIPTS_LUMINA),
    # LTX-2's Gemma 3 (its projections and connectors beside it: ComfyUI gives it no lora_te_)
    ("ltx2", "ComfyUI format", "text_encoders.gemma3_12b.transformer.model.layers.0.self_attn.q_proj", PEFT,
     GEMMA3 + "self_attn.q_proj.weight", COMFY_OWN),
    ("ltx2", "ComfyUI format", "text_encoders.transformer.model.layers.0.mlp.down_proj", PEFT,
     GEMMA3 + "mlp.down_proj.weight", COMFY_OWN),
    ("ltx2", "PEFT", "base_model.model.model.language_model.layers.0.self_attn.v_proj", PEFT,
     GEMMA3 + "self_attn.v_proj.weight", PEFT_GEMMA3),
    # Krea 2 (Qwen3-VL 4B), Flux.2 (Mistral Small 3.1), Z-Image (Qwen3 4B): no trainer's TE LoRA; PEFT's
    ("krea2", "PEFT", "base_model.model.model.language_model.layers.0.mlp.gate_proj", PEFT,
     QWEN3VL + "mlp.gate_proj.weight", PEFT_QWEN3VL),
    ("flux2", "PEFT", "base_model.model.model.language_model.layers.0.self_attn.k_proj", PEFT,
     MISTRAL + "self_attn.k_proj.weight", PEFT_MISTRAL3),
    ("z_image", "PEFT", "base_model.model.model.layers.0.self_attn.q_proj", PEFT,
     "qwen3_4b.transformer.model.layers.0.self_attn.q_proj.weight", PEFT_QWEN3),
    # SD3's three encoders, OneTrainer's kohya names
    ("sd3", "OneTrainer KOHYA", "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", LORA,
     CLIP_L + "self_attn.q_proj.weight", OT_SD3),
    ("sd3", "OneTrainer KOHYA", "lora_te2_text_model_encoder_layers_0_mlp_fc2", LORA,
     "clip_g.transformer.text_model.encoder.layers.0.mlp.fc2.weight", OT_SD3),
    ("sd3", "OneTrainer DIFFUSERS", "text_encoder_3.encoder.block.0.layer.0.SelfAttention.q", PEFT,
     "t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight", OT_SD3),
]


def _build(family: str):
    module, factory, kwargs, shortened = ENCODERS[family]
    try:
        found = importlib.import_module(f"comfy.text_encoders.{module}")
    except ImportError:
        return None
    if not hasattr(found, factory):
        return None
    options = {f"{name}_model_config": {"num_hidden_layers": DEPTH} for name in shortened}
    return getattr(found, factory)(**kwargs)(device="meta", dtype=torch.float16, model_options=options)


@pytest.fixture(scope="module")
def encoders():
    """family -> ComfyUI's text encoder on the meta device (built on first use), or None where this ComfyUI has none."""
    built = {}

    def get(family):
        if family not in built:
            built[family] = _build(family)
        if built[family] is None:
            pytest.skip(f"this ComfyUI has no {family} text encoder (comfy.text_encoders.{ENCODERS[family][0]})")
        return built[family]
    return get


def _report(encoder, state: dict, name: str = "te.safetensors"):
    lfile = parse_state_dict(state, name)
    return lfile, build_patches(lfile, lora_key_map(encoder, is_clip=True), {"clip": model_shapes(encoder)}, False)[1]


@pytest.mark.parametrize("family,trainer,name,suffixes,target,source",
                         [pytest.param(*row, id=f"{row[0]}-{row[1]}-{row[2]}") for row in NAMES])
def test_trainer_names_reach_their_text_encoder_weight(family, trainer, name, suffixes, target, source, encoders):
    encoder = encoders(family)
    shapes = model_shapes(encoder)
    shape = shapes[target]
    _, report = _report(encoder, _module(name, suffixes, shape[0], tuple(shape[1:])))
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    assert list(report.applied.values()) == [target]


def test_comfy_own_entries_are_kept(encoders):
    """Our names only add: every name ComfyUI's own map has keeps its target (HunyuanVideo's `lora_te1_` CLIP-L)."""
    encoder = encoders("hunyuan_video")
    own = comfy.lora.model_lora_keys_clip(encoder, {})
    ours = lora_key_map(encoder, is_clip=True)
    assert all(ours[name] == target for name, target in own.items())
    assert ours["lora_te1_text_model_encoder_layers_0_self_attn_q_proj"] == CLIP_L + "self_attn.q_proj.weight"


# --- lm_head: trained by OneTrainer, absent from ComfyUI's ports (harmless by design) ------------------------------

# OneTrainer wraps every Linear of a text encoder it trains (modules/module/LoRAModule.py
# LoRAModuleWrapper.__create_modules: no module filter for text encoders), so its causal-LM encoders' lm_head too:
OT_QWEN_HEAD = OT_QWEN + "; Qwen2_5_VLForConditionalGeneration.lm_head"
OT_HIDREAM_HEAD = ("Nerogar/OneTrainer HiDreamModel.lora_text_encoders (text_encoder_4 = LlamaForCausalLM: "
                   "text_encoder_4, lora_te4, text_encoders.llama.transformer) + LlamaForCausalLM.lm_head")
HEAD_REASON = next(rule.reason for rule in BY_DESIGN if "lm_head" in rule.what)
HEAD_WHAT = next(rule.what for rule in BY_DESIGN if "lm_head" in rule.what)

# (family, trainer's format, module name as written, suffixes, source); the module is shaped as the head of that
# encoder's language model: vocabulary x hidden width, the shape of ComfyUI's embed_tokens
LM_HEADS = [
    ("qwen_image", "OneTrainer LEGACY", "text_encoder.lm_head", LORA, OT_QWEN_HEAD),
    ("qwen_image", "OneTrainer KOHYA", "lora_te_lm_head", LORA, OT_QWEN_HEAD),
    ("qwen_image", "OneTrainer DIFFUSERS", "text_encoder.lm_head", PEFT, OT_QWEN_HEAD),
    ("qwen_image", "OneTrainer COMFY", "text_encoders.qwen25_7b.transformer.lm_head", PEFT, OT_QWEN_HEAD),
    ("hidream", "OneTrainer LEGACY", "text_encoder_4.lm_head", LORA, OT_HIDREAM_HEAD),
    ("hidream", "OneTrainer KOHYA", "lora_te4_lm_head", LORA, OT_HIDREAM_HEAD),
    ("hidream", "OneTrainer DIFFUSERS", "text_encoder_4.lm_head", PEFT, OT_HIDREAM_HEAD),
    ("hidream", "OneTrainer COMFY", "text_encoders.llama.transformer.lm_head", PEFT, OT_HIDREAM_HEAD),
]


def _embedding(shapes: dict) -> tuple[int, int]:
    (key,) = [key for key in shapes if key.endswith(".transformer.model.embed_tokens.weight")]
    return shapes[key]


@pytest.mark.parametrize("family,trainer,name,suffixes,source",
                         [pytest.param(*row, id=f"{row[0]}-{row[1]}-{row[2]}") for row in LM_HEADS])
def test_lm_head_is_harmless_on_an_encoder_without_one(family, trainer, name, suffixes, source, encoders):
    encoder = encoders(family)
    vocab, hidden = _embedding(model_shapes(encoder))
    state = {**_module(name, suffixes, vocab, (hidden,)),
             **_module(NAMES_BY[family], suffixes, *_out_in(encoder, family))}  # and a layer that applies
    _, report = _report(encoder, state)
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    assert report.harmless == [(f"{name}.weight", HEAD_REASON)] and len(report.applied) == 1
    assert report.line().endswith(f"1/2 modules applied (LoRA 1, {_share(report)}% of parameters), 1 not in this "
                                  f"model (harmless: {HEAD_WHAT})")


# one layer of each family's encoder, in the same trainer's names (rows of NAMES above)
NAMES_BY = {"qwen_image": "text_encoder.model.language_model.layers.0.self_attn.q_proj",
            "hidream": "text_encoder_4.model.layers.0.mlp.up_proj"}
TARGET_BY = {"qwen_image": QWEN25 + "self_attn.q_proj.weight", "hidream": LLAMA + "mlp.up_proj.weight"}


def _out_in(encoder, family: str) -> tuple[int, tuple[int, ...]]:
    out, *inner = model_shapes(encoder)[TARGET_BY[family]]
    return out, tuple(inner)


def _share(report) -> str:
    return f"{100 * report.params_applied / report.params_total:.0f}"


@pytest.mark.parametrize("family,name,shape,why", [
    ("qwen_image", "text_encoder.lm_head", (8, 16), "another width: not this encoder's head"),
    ("qwen_image", "text_encoder.lm_heads", None, "a name no encoder has"),
    ("qwen_image", "text_encoders.clip_l.transformer.lm_head", None, "a root this CLIP's language model is not"),
    ("hidream", "text_encoder_4.lm_head", (152064, 3584), "Qwen2.5-VL's head on HiDream's Llama"),
    ("sd3", "text_encoder.lm_head", (32128, 4096), "an encoder with no language model (T5's vocabulary)"),
])
def test_a_head_that_is_not_this_encoders_stays_a_failure(family, name, shape, why, encoders):
    encoder = encoders(family)
    rows, cols = shape or _embedding(model_shapes(encoders("qwen_image")))
    _, report = _report(encoder, _module(name, LORA, rows, (cols,)))
    assert report.harmless == [] and [(k, r.split(";")[0]) for k, r in report.problems] == [
        (f"{name}.weight", "no weight of this model has this name")], why


def test_a_head_comfy_builds_applies(encoders):
    """Qwen3-VL 8B keeps its lm_head in ComfyUI (JoyImage's encoder, Qwen3_8BConfig lm_head=True): the same name
    form lands on it, so the rule never hides a head that exists."""
    encoder = encoders("joyimage")
    head = "qwen3vl_8b.transformer.model.lm_head.weight"
    rows, cols = model_shapes(encoder)[head]
    _, report = _report(encoder, _module("text_encoders.qwen3vl_8b.transformer.model.lm_head", PEFT, rows, (cols,)))
    assert report.harmless == [] and report.problems == [] and list(report.applied.values()) == [head]


# --- values: a PEFT file over transformers' Qwen3 on ComfyUI's Z-Image text encoder --------------------------------

HIDDEN, INNER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 96, 2, 1, 128, 64, 3  # head_dim: fixed in ComfyUI; 3 layers: Z-Image encodes from layer -2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-4  # of the largest change of each weight


@pytest.fixture(scope="module")
def qwen3_pair():
    """ComfyUI's Z-Image text encoder (fp32, CPU, tiny) and transformers' Qwen3ForCausalLM holding its weights."""
    import transformers
    from comfy.text_encoders import z_image

    tiny = {"hidden_size": HIDDEN, "intermediate_size": INNER, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB}
    torch.manual_seed(0)
    comfy_te = z_image.te()(device="cpu", dtype=torch.float32, model_options={"qwen3_4b_model_config": tiny})
    config = transformers.Qwen3Config(**tiny, head_dim=HEAD_DIM, tie_word_embeddings=False)
    twin = transformers.Qwen3ForCausalLM(config).float()
    root = "qwen3_4b.transformer."
    ours = comfy_te.state_dict()
    for key, value in twin.state_dict().items():
        if key.startswith("model."):  # every weight of the language model, strictly the same shapes
            ours[root + key].copy_(torch.randn_like(value))
            value.copy_(ours[root + key])
    return comfy_te, twin


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_peft_file_on_a_language_model_text_encoder_equals_peft_merge(dora, qwen3_pair, tmp_path):
    import peft
    comfy_te, twin = qwen3_pair
    torch.manual_seed(7 + dora)
    model = peft.get_peft_model(copy.deepcopy(twin), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                      target_modules=TARGETS, use_dora=dora))
    for name, param in model.named_parameters():  # move DoRA's magnitude off the weight norm (a no-op otherwise)
        if "lora_magnitude_vector" in name:
            param.data.mul_(1 + 0.1 * torch.rand_like(param))
    model.save_pretrained(str(tmp_path / "qwen3"))
    before = {k: v.double() for k, v in twin.state_dict().items()}
    merged = {k: v.double() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}
    changed = {k for k in merged if not torch.equal(merged[k], before[k])}
    assert len(changed) == LAYERS * len(TARGETS)

    lfile = read(tmp_path / "qwen3" / "adapter_model.safetensors")
    patches, report = build_patches(lfile, lora_key_map(comfy_te, is_clip=True),
                                    {"clip": model_shapes(comfy_te)}, False)
    assert report.problems == [] and report.unused_keys == [] and len(report.applied) == len(changed)
    root = "qwen3_4b.transformer."
    assert sorted(report.applied.values()) == sorted(root + k for k in changed)
    for strength in (1.0, 0.5):
        patcher = comfy.model_patcher.ModelPatcher(comfy_te, load_device=torch.device("cpu"),
                                                   offload_device=torch.device("cpu"))
        patcher.add_patches(patches["clip"], strength)
        got = weights_after_full_load(patcher, [root + k for k in changed])
        for key in changed:
            change = strength * (merged[key] - before[key])
            error = (got[root + key].double() - (before[key] + change)).abs().max()
            assert error <= TOLERANCE * change.abs().max(), f"{key} @ {strength}: {error:.3g}"
    comfy.model_management.unload_all_models()


# --- the "made for" verdict of a text-encoder-only file ---------------------------------------------------------------

QWEN25_SHARED = ("a Qwen2.5-VL 7B text encoder (Qwen-Image, HunyuanImage 2.1, HunyuanVideo 1.5, Kandinsky 5, "
                 "LongCat-Image)")
QWEN3_4B_SHARED = ("a Qwen3 4B (or Qwen3-VL 4B) text encoder (Z-Image, Flux.2 klein 4B, Krea 2, MageFlow, "
                   "ACE-Step 1.5)")
HV_TE = {"lora_te1_layers_0_self_attn_q_proj": 4096, "lora_te1_layers_0_mlp_down_proj": 14336,
         "lora_te2_text_model_encoder_layers_0_self_attn_q_proj": 768}  # OneTrainer's HunyuanVideo TE file


@pytest.mark.parametrize("in_features,family", [
    pytest.param(HV_TE, "HunyuanVideo", id="hunyuan-video-onetrainer"),  # lora_te2_ is its CLIP-L, not SDXL's CLIP-G
    pytest.param({"text_encoder_4.model.layers.0.self_attn.q_proj": 4096,
                  "text_encoder_4.model.layers.0.mlp.down_proj": 14336}, "HiDream", id="hidream-llama-4th"),
    # the same Llama with no place in its names: HunyuanVideo's or HiDream's, so the encoder and both are named
    pytest.param({"text_encoders.llama.transformer.model.layers.0.self_attn.q_proj": 4096,
                  "text_encoders.llama.transformer.model.layers.0.mlp.down_proj": 14336},
                 "a Llama 3 8B text encoder (HunyuanVideo, HiDream)", id="llama-no-place"),
    pytest.param({"base_model.model.model.language_model.layers.0.self_attn.q_proj": 3840,
                  "base_model.model.model.language_model.layers.0.mlp.down_proj": 15360}, "LTX-2", id="ltx2-gemma3"),
    # shared encoders (ComfyUI 0.33's supported_models clip_target, families.LANGUAGE_MODEL_ENCODERS): the encoder and
    # every family that runs it; OneTrainer's Qwen-Image names (OT_QWEN, KOHYA)
    pytest.param({"lora_te_model_language_model_layers_0_self_attn_q_proj": 3584,
                  "lora_te_model_language_model_layers_0_mlp_down_proj": 18944}, QWEN25_SHARED, id="qwen25vl-shared"),
    # PEFT over Qwen3ForCausalLM (PEFT_QWEN3): Z-Image's, Flux.2 klein 4B's, ... (Qwen3-VL 4B's language model alike)
    pytest.param({"base_model.model.model.layers.0.self_attn.q_proj": 2560,
                  "base_model.model.model.layers.0.mlp.down_proj": 9728}, QWEN3_4B_SHARED, id="qwen3-4b-shared"),
    pytest.param({"lora_te_layers_0_self_attn_q_proj": 1024, "lora_te_layers_0_mlp_down_proj": 3072},
                 "a Qwen3 0.6B text encoder (Anima, ACE-Step 1.5)", id="qwen3-06b-sd-scripts-anima"),  # SD_SCRIPTS_ANIMA
    pytest.param({"lora_te_layers_0_mlp_up_proj": 2304, "lora_te_layers_0_mlp_down_proj": 9216},
                 "a Gemma 2 2B text encoder (Lumina 2, PixelDiT T2I)", id="gemma2-sd-scripts-lumina"),  # SD_SCRIPTS_LUMINA
    # attention only at 4096: Llama 3 8B's or Qwen3 8B's, both at the first place: nothing is said
    pytest.param({"text_encoder.layers.0.self_attn.q_proj": 4096}, None, id="hidden-4096-attention-only"),
    # a diffusion model's own modules still decide
    pytest.param({**HV_TE, "lora_unet_double_blocks_0_img_attn_qkv": 3072}, "Flux", id="dit-first"),
    # CLIP's encoder layers are no language model: kohya SDXL stays SDXL
    pytest.param({"lora_te1_text_model_encoder_layers_0_self_attn_q_proj": 768,
                  "lora_te2_text_model_encoder_layers_0_self_attn_q_proj": 1280}, "SDXL", id="sdxl-clips"),
])
def test_text_encoder_only_file_is_told_by_its_own_names(in_features, family):
    assert infer_family(in_features) == family


def test_verdict_names_hunyuan_video_for_its_text_encoder_file(encoders):
    """OneTrainer's HunyuanVideo TE file applies fully on HunyuanVideo's encoder (no verdict), and on SDXL's is
    said to be HunyuanVideo's, not SDXL's (the issue's 'looks made for SDXL')."""
    hv = encoders("hunyuan_video")
    shapes = model_shapes(hv)
    state = {}
    for name, target in (("lora_te1_layers_0_self_attn_q_proj", LLAMA + "self_attn.q_proj.weight"),
                         ("lora_te1_layers_0_mlp_down_proj", LLAMA + "mlp.down_proj.weight"),
                         ("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", CLIP_L + "self_attn.q_proj.weight")):
        state.update(_module(name, LORA, shapes[target][0], shapes[target][1:]))
    lfile, report = _report(hv, state)
    assert len(report.applied) == 3 and family_verdict(lfile, report, "HunyuanVideo") == ""

    sdxl = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16)
    lfile, report = _report(sdxl, state)
    assert family_verdict(lfile, report, "SDXL") == "This file looks made for HunyuanVideo, not for this SDXL."


# OneTrainer's Qwen-Image TE-only file (OT_QWEN: KOHYA names), on SDXL's CLIP: nothing applies. The verdict names the
# encoder and its families, and none on the model of one of them (ComfyUI 0.33's model class names).
QWEN_TE = [("lora_te_model_language_model_layers_0_self_attn_q_proj", QWEN25 + "self_attn.q_proj.weight"),
           ("lora_te_model_language_model_layers_0_mlp_down_proj", QWEN25 + "mlp.down_proj.weight")]


@pytest.mark.parametrize("model_family,verdict", [
    ("SDXL", f"This file looks made for {QWEN25_SHARED}, not for this SDXL."),
    ("Flux", f"This file looks made for {QWEN25_SHARED}, not for this Flux."),
    ("ZImage", f"This file looks made for {QWEN25_SHARED}, not for this ZImage."),
    *[(family, "") for family in ("QwenImage", "HunyuanImage21", "HunyuanVideo15", "HunyuanVideo15_SR_Distilled",
                                  "Kandinsky5", "Kandinsky5Image", "LongCatImage")],
])
def test_verdict_of_a_shared_text_encoder_file_names_its_families(model_family, verdict, encoders):
    shapes = model_shapes(encoders("qwen_image"))
    state = {}
    for name, target in QWEN_TE:
        state.update(_module(name, LORA, shapes[target][0], shapes[target][1:]))
    sdxl = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16)
    lfile, report = _report(sdxl, state)
    assert report.applied == {} and len(report.problems) == 2
    assert family_verdict(lfile, report, model_family) == verdict
