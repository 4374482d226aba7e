"""The module names trainers write for ComfyUI 0.33's newest video families, through our loader's key map: MiniMax H3,
Kandinsky 5 (video and image), HunyuanVideo 1.5, LTX-2 with audio, and Wan 2.2 (T2V A14B, TI2V 5B, and the
Lightning distill files musubi-tuner converts).

Same method as tests/test_trainer_names.py (whose helpers this reuses): each entry is one module under the exact name
one trainer's saver writes (its save code is cited beside it), shaped from ComfyUI's own model of the family, built on
the meta device at its released widths, one or two blocks deep; it must land on the right weight, and for a fused
weight on the right rows, or be refused with the reason. These families exist in ComfyUI 0.33 only (0.3.75 has no
supported_models.MiniMaxH3, Kandinsky5, HunyuanVideo15, LTXAV, WAN22_T2V): their cases skip there, saying why.
"""

import comfy.supported_models as supported
import pytest
import torch
from lycoris_nodes.nodes.glue.keymap import component_module_paths, model_shapes
from lycoris_nodes.nodes.glue.patch_key import Offset
from test_trainer_names import (
    AI_TOOLKIT_WAN,
    DIFFSYNTH,
    HV15_CONFIG,
    LORA,
    MUSUBI,
    PEFT,
    PEFT_DEFAULT,
    SIMPLETUNER_LYCORIS,
    SIMPLETUNER_PEFT,
    WAN_CONFIG,
)
from test_trainer_names import _report as names_report

# Released widths (ComfyUI's defaults and model_detection.py), one block per stack
MINIMAX_CONFIG = {"image_model": "minimax_h3", "num_layers": 1, "token_refiner_num_layers": 1}
MM_INNER = 56 * 128  # heads x head_dim: each of q, k, v is a third of qkv_proj's rows
MM_QKV = "diffusion_model.blocks.0.attn.qkv_proj.weight"
MM_FC1 = "diffusion_model.blocks.0.mlp.fc1.weight"
# diffusers' SwiGLU input (ff.net.0.proj) is value first where ComfyUI's fc1 is gate first: the file's rows are
# fc1's second half, then its first (diffusers' _convert_non_diffusers_minimax_h3_lora_to_diffusers swaps them;
# diffusers_names.json records the two pieces), each applied as a module of its own
HALVES_SWAPPED = "halves swapped"
MM_OUT = "diffusion_model.blocks.0.attn.out_proj.weight"
KANDINSKY_CONFIG = {"image_model": "kandinsky5", "num_text_blocks": 1, "num_visual_blocks": 1}  # Lite video, 1792
KANDINSKY_IMAGE_CONFIG = {**KANDINSKY_CONFIG, "model_dim": 2560, "visual_embed_dim": 64, "ff_dim": 10240,
                          "axes_dims": (32, 48, 48), "rope_scale_factor": (1.0, 1.0, 1.0)}
HV15 = HV15_CONFIG["hidden_size"]
HV15_IMG_QKV = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
HV15_TXT_QKV = "diffusion_model.double_blocks.0.txt_attn.qkv.weight"
# LTX-2 at its released widths: video 4096 (32 heads of 128), audio 2048, the connectors' 30 heads of 128
LTX2_CONFIG = {"image_model": "ltxav", "num_layers": 1, "attention_head_dim": 128, "cross_attention_dim": 4096,
               "num_attention_heads": 32, "caption_channels": 3840, "connector_num_layers": 1}
LTX2_AUDIO_CONNECTOR_Q = "diffusion_model.audio_embeddings_connector.transformer_1d_blocks.0.attn1.to_q.weight"
WAN22_5B_CONFIG = {**WAN_CONFIG, "dim": 3072, "ffn_dim": 14336, "num_heads": 24, "num_layers": 1, "freq_dim": 256,
                   "text_dim": 4096, "in_dim": 48, "out_dim": 48}
WAN22_A14B_CONFIG = {**WAN_CONFIG, "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 1, "freq_dim": 256,
                     "text_dim": 4096}
WAN_Q = "diffusion_model.blocks.0.self_attn.q.weight"
WAN_CROSS_K = "diffusion_model.blocks.0.cross_attn.k.weight"

MODELS = {"minimax_h3": ("MiniMaxH3", MINIMAX_CONFIG), "kandinsky5": ("Kandinsky5", KANDINSKY_CONFIG),
          "kandinsky5_image": ("Kandinsky5Image", KANDINSKY_IMAGE_CONFIG),
          "hunyuan_video15": ("HunyuanVideo15", HV15_CONFIG), "ltx2": ("LTXAV", LTX2_CONFIG),
          "wan22_5b": ("WAN22_T2V", WAN22_5B_CONFIG), "wan22_a14b": ("WAN21_T2V", WAN22_A14B_CONFIG)}

# --- sources (repository snapshots read: musubi-tuner 30c658c4, SimpleTuner bc8e6ab7, ai-toolkit 27a03a9,
# DiffSynth-Studio fed7b18f, diffusers 0.42.1 as installed, Comfy-Org/ComfyUI 17358c8f = 0.38) ---------------------
AIT_MINIMAX = ("ostris/ai-toolkit extensions_built_in/diffusion_models/minimax_h3/minimax_h3.py "
               "convert_lora_weights_before_save (transformer. -> diffusion_model. + the original names)")
# The vendors' turbo LoRAs name the original checkpoint's modules, bare ("original" form, as the reference
# generate.py) or under diffusion_model. ("comfyui" form): diffusers' MiniMaxH3LoraLoaderMixin.lora_state_dict reads
# both as non-diffusers (is_non_diffusers_format); ComfyUI 0.38 lists the bare names in its own map
# (Comfy-Org/ComfyUI comfy/lora.py model_lora_keys_unet, MiniMaxH3 branch).
MINIMAX_TURBO = "diffusers MiniMaxH3LoraLoaderMixin.lora_state_dict; Comfy-Org/ComfyUI comfy/lora.py (0.38) MiniMaxH3"
# lightx2v's MiniMax H3 turbo files: diffusers module names, no prefix, PEFT's adapter name kept
# (DiffSynth-Studio diffsynth/utils/lora/minimax_h3.py MiniMaxH3LoRALoader.is_lightx2v_format)
LIGHTX2V_MINIMAX = "modelscope/DiffSynth-Studio diffsynth/utils/lora/minimax_h3.py is_lightx2v_format"
# DiffSynth-Studio trains PEFT on its own MiniMax H3 (diffsynth/models/minimax_h3_dit.py): the original names, no
# prefix, `.default.` kept; its MiniMaxH3Attention (the original checkpoint) reads qkv_proj's rows per head as [q k v]
# (qkv.view(total, heads, 3, head_dim)), its MiniMaxH3DiTComfy (Comfy-Org's checkpoints, minimax_h3_dit_comfy.py) as
# ComfyUI's [q; k; v] (comfy/ldm/minimax/model.py Attention.forward): qkv_proj is refused until told the checkpoint (keymap.ROW_ORDER_UNKNOWN)
DIFFSYNTH_MINIMAX = "modelscope/DiffSynth-Studio diffsynth/models/minimax_h3_dit.py (PEFT on its own model)"
SIMPLETUNER_MINIMAX = ("bghira/SimpleTuner helpers/models/minimaxh3 (diffusers' MiniMaxH3Transformer3DModel: to_q/k/v "
                       "rows of qkv_proj, as diffusers' _convert_non_diffusers_minimax_h3_lora_to_diffusers splits)")
# musubi-tuner's Kandinsky 5 network (src/musubi_tuner/networks/lora_kandinsky.py create_arch_network: lora_unet_ +
# the model's own paths, TransformerEncoderBlock and TransformerDecoderBlock, attention and feed-forward)
MUSUBI_KANDINSKY = "kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_kandinsky.py"
# The official trainer (kandinsky-5-lora-train/train/lora_train.py: get_peft_model(dit); checkpoint.py
# save_adapter_model: the PeftModel's state dict, `base_model.model.` + the DiT's paths + `.lora_A.default.weight`)
KANDINSKY_OFFICIAL = "kandinskylab/kandinsky-5 kandinsky-5-lora-train/train/checkpoint.py save_adapter_model"
# diffusers' Kandinsky5Transformer3DModel names every module as Kandinsky's own DiT (and ComfyUI) does
SIMPLETUNER_KANDINSKY = "bghira/SimpleTuner helpers/models/kandinsky5_{video,image} (diffusers' Kandinsky5 names)"
# musubi-tuner's HunyuanVideo 1.5 (src/musubi_tuner/networks/lora_hv_1_5.py: MMDoubleStreamBlock, lora_unet_; its
# hunyuan_video_1_5_modules.py splits the attention into img_attn_q/_k/_v, which its own
# networks/convert_hunyuan_video_1_5_lora_to_comfy.py concatenates in that order into ComfyUI's fused `_qkv`)
MUSUBI_HV15 = "kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_hv_1_5.py + convert_hunyuan_video_1_5_lora_to_comfy.py"
# SimpleTuner's comfyui format (helpers/training/lora_format.py convert_diffusers_to_comfyui: `diffusion_model.` in
# place of `transformer.`, the diffusers path kept); its LTX-2 hangs the text connectors on the transformer
# (helpers/models/ltxvideo2/model.py: model.connectors), which diffusers names as checkpoint_loader.py's
# LTX_2_0_CONNECTORS_KEYS_RENAME_DICT reverses (audio_embeddings_connector.transformer_1d_blocks <-> connectors.
# audio_connector.transformer_blocks)
SIMPLETUNER_COMFY = "bghira/SimpleTuner helpers/training/lora_format.py convert_diffusers_to_comfyui"
AIT_LTX2 = "ostris/ai-toolkit extensions_built_in/diffusion_models/ltx2/ltx2.py convert_lora_weights_before_save"
DIFFSYNTH_LTX2 = "modelscope/DiffSynth-Studio diffsynth/utils/state_dict_converters/ltx2_dit.py (original names)"
# lightx2v's Wan 2.2 Lightning files: `diffusion_model.` + Wan's own paths with lora_down/lora_up/alpha, which
# musubi-tuner's convert_lora.py convert_from_diffusers reads since PR #508 (27c5a18: "unknown format"), writing
# `lora_unet_` + the path, dots as underscores, the file's own alpha kept
LIGHTNING = "kohya-ss/musubi-tuner src/musubi_tuner/convert_lora.py convert_from_diffusers (PR #508)"

HERE = "this ComfyUI has no supported_models.{}"

NAMES = [
    ("ai-toolkit", "minimax_h3", "diffusion_model.blocks.0.attn.qkv_proj", PEFT, MM_QKV, None, AIT_MINIMAX),
    ("ai-toolkit", "minimax_h3", "diffusion_model.blocks.0.mlp.fc1", PEFT, MM_FC1, None, AIT_MINIMAX),
    ("ai-toolkit", "minimax_h3", "diffusion_model.token_refiner.blocks.0.attn.qkv_proj", PEFT,
     "diffusion_model.token_refiner.blocks.0.attn.qkv_proj.weight", None, AIT_MINIMAX),
    ("MiniMax turbo (original)", "minimax_h3", "blocks.0.attn.qkv_proj", PEFT, MM_QKV, None, MINIMAX_TURBO),
    ("MiniMax turbo (original)", "minimax_h3", "blocks.0.adaln_proj.linear", PEFT,
     "diffusion_model.blocks.0.adaln_proj.linear.weight", None, MINIMAX_TURBO),
    ("MiniMax turbo (comfyui)", "minimax_h3", "diffusion_model.blocks.0.mlp.fc2", PEFT,
     "diffusion_model.blocks.0.mlp.fc2.weight", None, MINIMAX_TURBO),
    ("lightx2v turbo", "minimax_h3", "transformer_blocks.0.attn.to_q", PEFT_DEFAULT, MM_QKV, (0, 0, MM_INNER),
     LIGHTX2V_MINIMAX),
    ("lightx2v turbo", "minimax_h3", "transformer_blocks.0.attn.to_v", PEFT_DEFAULT, MM_QKV,
     (0, 2 * MM_INNER, MM_INNER), LIGHTX2V_MINIMAX),
    ("lightx2v turbo", "minimax_h3", "transformer_blocks.0.attn.to_out.0", PEFT_DEFAULT, MM_OUT, None,
     LIGHTX2V_MINIMAX),
    ("lightx2v turbo", "minimax_h3", "transformer_blocks.0.ff.net.0.proj", PEFT_DEFAULT, MM_FC1, HALVES_SWAPPED,
     LIGHTX2V_MINIMAX),
    ("DiffSynth-Studio", "minimax_h3", "blocks.0.attn.out_proj", PEFT_DEFAULT, MM_OUT, None, DIFFSYNTH_MINIMAX),
    ("DiffSynth-Studio", "minimax_h3", "blocks.0.mlp.fc1", PEFT_DEFAULT, MM_FC1, None, DIFFSYNTH_MINIMAX),
    ("SimpleTuner", "minimax_h3", "transformer.transformer_blocks.0.attn.to_k", PEFT, MM_QKV, (0, MM_INNER, MM_INNER),
     SIMPLETUNER_MINIMAX),
    ("SimpleTuner", "minimax_h3", "transformer.token_refiner.refiner_blocks.0.attn.to_q", PEFT,
     "diffusion_model.token_refiner.blocks.0.attn.qkv_proj.weight", (0, 0, MM_INNER), SIMPLETUNER_MINIMAX),
    ("SimpleTuner", "minimax_h3", "lycoris_transformer_blocks_0_attn_to_v", LORA, MM_QKV,
     (0, 2 * MM_INNER, MM_INNER), SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "minimax_h3", "transformer.transformer_blocks.0.ff.net.2", PEFT,
     "diffusion_model.blocks.0.mlp.fc2.weight", None, SIMPLETUNER_MINIMAX),
    ("SimpleTuner", "kandinsky5", "transformer.visual_transformer_blocks.0.self_attention.to_query", PEFT,
     "diffusion_model.visual_transformer_blocks.0.self_attention.to_query.weight", None, SIMPLETUNER_KANDINSKY),
    ("SimpleTuner", "kandinsky5", "lycoris_visual_transformer_blocks_0_cross_attention_to_key", LORA,
     "diffusion_model.visual_transformer_blocks.0.cross_attention.to_key.weight", None, SIMPLETUNER_LYCORIS),
    ("musubi-tuner", "kandinsky5", "lora_unet_visual_transformer_blocks_0_feed_forward_in_layer", LORA,
     "diffusion_model.visual_transformer_blocks.0.feed_forward.in_layer.weight", None, MUSUBI_KANDINSKY),
    ("musubi-tuner", "kandinsky5", "lora_unet_text_transformer_blocks_0_self_attention_to_value", LORA,
     "diffusion_model.text_transformer_blocks.0.self_attention.to_value.weight", None, MUSUBI_KANDINSKY),
    ("Kandinsky 5 trainer", "kandinsky5", "base_model.model.visual_transformer_blocks.0.self_attention.out_layer",
     PEFT_DEFAULT, "diffusion_model.visual_transformer_blocks.0.self_attention.out_layer.weight", None,
     KANDINSKY_OFFICIAL),
    ("SimpleTuner", "kandinsky5_image", "transformer.visual_transformer_blocks.0.cross_attention.to_value", PEFT,
     "diffusion_model.visual_transformer_blocks.0.cross_attention.to_value.weight", None, SIMPLETUNER_KANDINSKY),
    ("Kandinsky 5 trainer", "kandinsky5_image", "base_model.model.visual_transformer_blocks.0.feed_forward.out_layer",
     PEFT_DEFAULT, "diffusion_model.visual_transformer_blocks.0.feed_forward.out_layer.weight", None,
     KANDINSKY_OFFICIAL),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_img_attn_q", LORA, HV15_IMG_QKV, (0, 0, HV15),
     MUSUBI_HV15),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_img_attn_k", LORA, HV15_IMG_QKV, (0, HV15, HV15),
     MUSUBI_HV15),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_txt_attn_v", LORA, HV15_TXT_QKV,
     (0, 2 * HV15, HV15), MUSUBI_HV15),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_img_attn_proj", LORA,
     "diffusion_model.double_blocks.0.img_attn.proj.weight", None, MUSUBI_HV15),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_img_mlp_fc1", LORA,
     "diffusion_model.double_blocks.0.img_mlp.0.weight", None, MUSUBI_HV15),
    ("musubi-tuner", "hunyuan_video15", "lora_unet_double_blocks_0_txt_mod_linear", LORA,
     "diffusion_model.double_blocks.0.txt_mod.lin.weight", None, MUSUBI_HV15),
    ("musubi-tuner (to comfy)", "hunyuan_video15", "lora_unet_double_blocks_0_img_attn_qkv", LORA, HV15_IMG_QKV,
     None, MUSUBI_HV15),
    # SimpleTuner's LyCORIS wrapper on its HunyuanVideo15Transformer3DModel (diffusers' names; values checked in
    # tests/test_hunyuan_video15_lycoris.py): the double blocks' q/k/v on rows of the fused qkv, the token refiner's
    ("SimpleTuner", "hunyuan_video15", "lycoris_transformer_blocks_0_attn_add_q_proj", LORA, HV15_TXT_QKV,
     (0, 0, HV15), SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "hunyuan_video15", "lycoris_transformer_blocks_0_ff_net_0_proj", LORA,
     "diffusion_model.double_blocks.0.img_mlp.0.weight", None, SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "hunyuan_video15", "lycoris_context_embedder_token_refiner_refiner_blocks_0_attn_to_k", LORA,
     "diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight", (0, HV15, HV15),
     SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "ltx2", "diffusion_model.transformer_blocks.0.audio_attn2.to_k", PEFT,
     "diffusion_model.transformer_blocks.0.audio_attn2.to_k.weight", None, SIMPLETUNER_COMFY),
    ("SimpleTuner", "ltx2", "lycoris_connectors_audio_connector_transformer_blocks_0_attn1_to_q", LORA,
     LTX2_AUDIO_CONNECTOR_Q, None, SIMPLETUNER_COMFY),
    ("SimpleTuner", "ltx2", "diffusion_model.connectors.audio_connector.transformer_blocks.0.attn1.to_q", PEFT,
     LTX2_AUDIO_CONNECTOR_Q, None, SIMPLETUNER_COMFY),
    ("SimpleTuner", "ltx2", "transformer.connectors.video_connector.transformer_blocks.0.ff.net.2", PEFT,
     "diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.ff.net.2.weight", None, SIMPLETUNER_PEFT),
    ("ai-toolkit", "ltx2", "diffusion_model.transformer_blocks.0.video_to_audio_attn.to_q", PEFT,
     "diffusion_model.transformer_blocks.0.video_to_audio_attn.to_q.weight", None, AIT_LTX2),
    ("DiffSynth-Studio", "ltx2", "transformer_blocks.0.audio_ff.net.2", PEFT_DEFAULT,
     "diffusion_model.transformer_blocks.0.audio_ff.net.2.weight", None, DIFFSYNTH_LTX2),
    ("musubi-tuner", "wan22_5b", "lora_unet_blocks_0_self_attn_q", LORA, WAN_Q, None, MUSUBI),
    ("ai-toolkit", "wan22_5b", "diffusion_model.blocks.0.ffn.0", PEFT, "diffusion_model.blocks.0.ffn.0.weight", None,
     AI_TOOLKIT_WAN),
    ("DiffSynth-Studio", "wan22_5b", "blocks.0.cross_attn.k", PEFT_DEFAULT, WAN_CROSS_K, None, DIFFSYNTH),
    ("SimpleTuner", "wan22_5b", "transformer.blocks.0.attn2.to_k", PEFT, WAN_CROSS_K, None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "wan22_5b", "diffusion_model.blocks.0.attn1.to_q", PEFT, WAN_Q, None, SIMPLETUNER_COMFY),
    ("musubi-tuner", "wan22_a14b", "lora_unet_blocks_0_cross_attn_k", LORA, WAN_CROSS_K, None, MUSUBI),
    ("lightx2v Lightning", "wan22_a14b", "diffusion_model.blocks.0.cross_attn.k", LORA, WAN_CROSS_K, None, LIGHTNING),
    ("musubi-tuner (Lightning converted)", "wan22_a14b", "lora_unet_blocks_0_self_attn_q", LORA, WAN_Q, None,
     LIGHTNING),
    ("lightx2v Lightning", "wan22_5b", "diffusion_model.blocks.0.self_attn.q", LORA, WAN_Q, None, LIGHTNING),
]


def _params() -> list:
    params = []
    for entry in NAMES:
        trainer, arch, name = entry[:3]
        cls = MODELS[arch][0]
        marks = [] if hasattr(supported, cls) else [pytest.mark.skip(reason=HERE.format(cls))]
        params.append(pytest.param(*entry, id=f"{trainer}-{arch}-{name}", marks=marks))
    return params


@pytest.fixture(scope="module")
def video_models():
    """ComfyUI's own model classes, on the meta device (those this ComfyUI has)."""
    return {arch: getattr(supported, cls)(dict(config)).get_model({}, "", device="meta")
            for arch, (cls, config) in MODELS.items() if hasattr(supported, cls)}


def _report(arch, name, suffixes, target, rows, video_models):
    """Our coverage report for a one-module file with this name, shaped for `target` (rows of it)."""
    return names_report(arch, name, suffixes, target, rows, None, video_models)


@pytest.mark.parametrize("trainer,arch,name,suffixes,target,rows,source", _params())
def test_trainer_names_reach_their_weight(trainer, arch, name, suffixes, target, rows, source, video_models):
    swapped = rows == HALVES_SWAPPED
    report = _report(arch, name, suffixes, target, None if swapped else rows, video_models)
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    module_key = next(iter(report.applied))
    assert report.applied == {module_key: target}
    offsets = [applied.target.offset for key, applied in report.targets.items()
               if key == module_key or key.startswith(module_key + "[")]
    half = model_shapes(video_models[arch])[target][0] // 2
    assert offsets == ([Offset(0, half, half), Offset(0, 0, half)] if swapped else [Offset.from_comfy(rows)])


def test_diffsynth_minimax_qkv_rows_are_refused_by_name(video_models):
    """DiffSynth-Studio's MiniMax H3 LoRAs keep PEFT's `.default.` (DIFFSYNTH_MINIMAX) and change qkv_proj's rows per
    head (its MiniMaxH3DiT, the original checkpoint) or as ComfyUI's [q; k; v] (its MiniMaxH3DiTComfy, Comfy-Org's
    checkpoints), under one name and shape, and the file does not say which: refused by name, saying why, never
    applied as stacked. The same bare name without `.default.` (the turbo LoRAs, NAMES above) applies."""
    if not hasattr(supported, "MiniMaxH3"):
        pytest.skip(HERE.format("MiniMaxH3"))
    for name in ("blocks.0.attn.qkv_proj", "token_refiner.blocks.0.attn.qkv_proj"):
        target = f"diffusion_model.{name}.weight"
        report = _report("minimax_h3", name, PEFT_DEFAULT, target, None, video_models)
        assert report.applied == {}
        assert [(key, reason.split(":")[0]) for key, reason in report.problems] == [
            (f"{name}.weight", "row order unknown")]
        turbo = _report("minimax_h3", name, PEFT, target, None, video_models)
        assert turbo.problems == [] and turbo.applied == {f"{name}.weight": target}


def test_ltx2_connector_names_are_diffusers_modules(video_models):
    """The names keymap.COMPONENT_RENAMES gives LTX-2's text connectors are modules of diffusers' own
    LTX2TextConnectors (the component SimpleTuner hangs on the transformer as `connectors`), at ComfyUI's shapes:
    every Linear of ComfyUI's connectors, at released widths. Their q/k norms (`q_norm`, diffusers' `norm_q`) are
    no Linear and keep ComfyUI's name (not read under diffusers')."""
    if not hasattr(supported, "LTXAV"):
        pytest.skip(HERE.format("LTXAV"))
    from diffusers.pipelines.ltx2 import connectors
    model = video_models["ltx2"]
    with torch.device("meta"):
        twin = connectors.LTX2TextConnectors(video_connector_num_layers=1, audio_connector_num_layers=1)
    theirs = {f"connectors.{key.removesuffix('.weight')}": tuple(value.shape)
              for key, value in twin.state_dict().items() if key.endswith(".weight")}
    ours = {path: tuple(model.state_dict()[key].shape) for path, key in component_module_paths(model)
            if not path.endswith(("q_norm", "k_norm"))}
    assert len(ours) == 12  # q, k, v, out, ff in and out, in each connector's one block
    assert {path: theirs.get(path) for path in ours} == ours
