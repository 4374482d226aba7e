"""The module names trainers write for the image and audio families of ComfyUI 0.33, through our loader's key map.

As tests/test_trainer_names.py (whose helpers this reuses): each entry is a one-module file with the exact name one
trainer's saver writes (its source cited beside it), shaped for ComfyUI's own model of that family built on the meta
device at its released widths, one block deep; it must land on the right weight and rows. Ideogram 4, ERNIE-Image,
Anima, ACE-Step 1.5, LongCat-Image, Qwen-Image(-Edit), HunyuanImage 2.1 and HiDream-O1 exist in ComfyUI 0.33 only:
their cases are skipped on 0.3.75, saying so.

The repository snapshots read: Nerogar/OneTrainer at 23df3832, kohya-ss/musubi-tuner at 30c658c4, kohya-ss/sd-scripts
at 48d368fa, bghira/SimpleTuner at bc8e6ab7, ostris/ai-toolkit at 27a03a91, Comfy-Org/ComfyUI at 17358c8 (0.38).
"""

import comfy.supported_models as supported
import pytest
import torch
from derive_names import derive
from lycoris_nodes.lycoris_core.families import infer_family
from lycoris_nodes.nodes.glue.patch_key import Offset
from test_trainer_names import LORA, PEFT, PEFT_DEFAULT, ZIMAGE_CONFIG, _report

pytestmark = pytest.mark.usefixtures("one_thread")

# ComfyUI's models at released widths, one block deep (the config keys ComfyUI's detection sets; the classes' own
# defaults are the released sizes where detection sets none)
CONFIGS = {
    "ideogram4": ("Ideogram4", {"image_model": "ideogram4", "in_channels": 128, "num_layers": 1}),
    "ernie": ("ErnieImage", {"image_model": "ernie", "num_layers": 1}),
    "anima": ("Anima", derive._cosmos_predict2(num_blocks=1, image_model="anima")),
    # ACE-Step 1.5 computes its quantizer's codebook at construction, which the meta device cannot: tiny, on the CPU
    "acestep15": ("ACEStep15", {"audio_model": "ace1.5", "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1,
                                "head_dim": 32, "intermediate_size": 128, "num_dit_layers": 1, "num_lyric_layers": 1,
                                "num_timbre_layers": 1, "num_tokenizer_layers": 1, "fsq_dim": 64,
                                "text_hidden_dim": 64, "encoder_hidden_size": 64, "encoder_intermediate_size": 128,
                                "encoder_num_heads": 2}),
    "qwen_image": ("QwenImage", {"image_model": "qwen_image", "num_layers": 1}),
    # supported_models.LongCatImage: Flux's blocks at 3072 with a 3584-wide Qwen2.5-VL context, no pooled vector
    "longcat": ("LongCatImage", derive._flux(depth=1, depth_single_blocks=1, hidden_size=3072, num_heads=24,
                                             in_channels=64, out_channels=64, context_in_dim=3584, vec_in_dim=None,
                                             guidance_embed=False, txt_ids_dims=[1, 2], axes_dim=[16, 56, 56])),
    # ComfyUI's detection of HunyuanImage 2.1 (model_detection.py, its HunyuanVideo branch): 2D patches, no pooled
    # vector, byT5 glyph input, 3584 wide; the refiner is the same DiT with 3D patches and a guidance input
    "hunyuan_image21": ("HunyuanImage21", derive._hunyuan_video(
        depth=1, depth_single_blocks=1, vec_in_dim=None, patch_size=[1, 1], axes_dim=[64, 64], in_channels=64,
        out_channels=64, hidden_size=3584, num_heads=28, context_in_dim=3584, byt5=True, guidance_embed=False)),
    "hunyuan_image21_refiner": ("HunyuanImage21Refiner", derive._hunyuan_video(
        depth=1, depth_single_blocks=1, vec_in_dim=None, in_channels=128, out_channels=64, hidden_size=3584,
        num_heads=28, context_in_dim=3584, byt5=True, patch_size=[1, 1, 1])),
    "hidream_o1": ("HiDreamO1", {"image_model": "hidream_o1"}),  # one released size (36 language layers)
    "krea2": ("Krea2", {"image_model": "krea2", "layers": 1}),
    "flux2": ("Flux2", derive._flux2(depth=1, depth_single_blocks=1)),
}
PARAMS = {"hunyuan_image21": "comfy.ldm.hunyuan_video.model.HunyuanVideoParams",
          "hunyuan_image21_refiner": "comfy.ldm.hunyuan_video.model.HunyuanVideoParams",
          "flux2": "comfy.ldm.flux.model.FluxParams", "longcat": "comfy.ldm.flux.model.FluxParams"}

IG, IG_H = "diffusion_model.", 4608  # Ideogram 4: 18 heads x 256
IG_QKV = IG + "layers.0.attention.qkv.weight"
AN = "diffusion_model.blocks.0."

# Nerogar/OneTrainer modules/modelSaver/mixin/LoRASaverMixin.py: DIFFUSERS = `transformer.` + diffusers' module path,
# lora_A/lora_B, alpha folded into lora_B (convert_to_diffusers); KOHYA = `lora_unet_` + the model's
# lora_diffusers_to_kohya body, flattened (kohya_flatten); ORIGINAL = the lora_diffusers_to_original body, no prefix;
# COMFY = `diffusion_model.` + the lora_diffusers_to_comfy body; ORIGINAL/COMFY/KOHYA keep alpha with lora_A/lora_B
# or lora_down/lora_up; DIFFUSERS/LEGACY keep q/k/v split, the others fuse them (ModelFormat.needs_qkv_fusion).
OT = "Nerogar/OneTrainer LoRASaverMixin._save_{fmt} + modules/model/{model}.py"
OT_IG = OT.format(fmt="diffusers", model="IdeogramModel (diffusers' Ideogram4Transformer2DModel names)")
OT_IG_FUSED = OT.format(fmt="kohya/_original/_comfy", model="IdeogramModel (fusion_groups attention.qkv, "
                                                            "diffusers_to_original to_out.0 -> o)")
OT_ERNIE = OT.format(fmt="diffusers/_legacy/_kohya/_comfy", model="ErnieModel (no rename: ComfyUI's names)")
OT_ANIMA = OT.format(fmt="diffusers", model="AnimaModel (diffusers' CosmosTransformer3DModel names)")
OT_ANIMA_DIT = OT.format(fmt="kohya/_comfy/_original", model="AnimaModel (_diffusers_to_dit; ORIGINAL adds net.)")
MUSUBI_IG = "kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_ideogram4.py (lora_unet_, attention.qkv/o, w1-3)"
ST = "bghira/SimpleTuner simpletuner/helpers/training/save_hooks.py _save_lora / _save_lycoris"
ST_IG = ST + " + helpers/models/ideogram/transformer.py (original names: attention.qkv, .o)"
ST_ERNIE = ST + " + helpers/models/ernie/model.py (ErnieImageTransformer2DModel, to_q/k/v/out.0)"
ST_ANIMA = ST + " + helpers/models/anima (diffusers' Cosmos names, to_q/k/v/out.0)"
ST_LONGCAT = ST + " + helpers/models/longcat_image/model.py (Flux's diffusers names, DEFAULT_LORA_TARGET)"
AIT = "ostris/ai-toolkit extensions_built_in/diffusion_models/{}: convert_lora_weights_before_save"
SD_ANIMA = "kohya-ss/sd-scripts networks/lora_anima.py (lora_unet_ + library/anima_models.py paths; lycoris.kohya too)"
# diffusers 0.42.1 loaders/lora_conversion_utils.py: what diffusers itself reads as these families' names
DIFFUSERS_IG = "diffusers _convert_non_diffusers_ideogram4_lora_to_diffusers (fused qkv -> to_q/k/v thirds)"
COMFY_TRAINER = "Comfy-Org/ComfyUI comfy_extras/nodes_train.py TrainLoraNode (diffusion_model. + ComfyUI's path)"
ACE_OFFICIAL = "Comfy-Org/ComfyUI comfy/lora.py model_lora_keys_unet ACEStep15 (official base_model.model. LoRAs)"
ACE_ST = "bghira/SimpleTuner LyCORIS on ACE-Step 1.5's decoder (Comfy-Org/ComfyUI#12638: lycoris_layers_0_cross_attn_…)"
SD_HI = ("kohya-ss/sd-scripts networks/lora_hunyuan_image.py (lora_unet_ + library/hunyuan_image_models.py: Tencent's "
         "img_mlp.fc1, img_mod.linear, modulation.linear; networks/convert_hunyuan_image_lora_to_comfy.py)")
SD_HI_COMFY = "kohya-ss/sd-scripts networks/convert_hunyuan_image_lora_to_comfy.py (its output: ComfyUI's names)"
COMFY_038_HIDREAM = "Comfy-Org/ComfyUI comfy/lora.py model_lora_keys_unet at 17358c8 (HiDreamO1: model. + path)"
MUSUBI_HIDREAM = ("kohya-ss/musubi-tuner networks/lora_hidream_o1.py + hidream_o1/hidream_o1_utils.py "
                  "(Qwen3VLForConditionalGeneration: lora_unet_ + model. + the checkpoint's paths)")
# DiffSynth-Studio (modelscope/DiffSynth-Studio at fed7b18f) saves PEFT's state dict of its own model with no prefix
# and `.default.` kept (diffsynth/diffusion/logger.py ModelLogger.save_model: export_trainable_state_dict minus
# --remove_prefix_in_ckpt "pipe.dit.", identity converter). Its ports keep ComfyUI's paths: ErnieImageDiT
# (diffsynth/models/ernie_image_dit.py, loaded from diffusers' checkpoint unconverted; examples/ernie_image/
# model_training/lora/ERNIE-Image.sh targets to_q,to_k,to_v,to_out.0) and AnimaDiT (diffsynth/models/anima_dit.py:
# ComfyUI's MiniTrainDIT + llm_adapter; AnimaDiTStateDictConverter only drops `net.`; examples/anima/model_training/
# lora/anima-preview.sh passes --lora_target_modules "", so training_module.py auto_detect_lora_target_modules takes
# every Linear at least 512 wide in blocks and llm_adapter.blocks)
DS_ERNIE = "modelscope/DiffSynth-Studio diffsynth/models/ernie_image_dit.py + diffusion/logger.py ModelLogger.save_model"
# Its Ideogram 4 (diffsynth/models/ideogram4_dit.py Ideogram4DiT: the checkpoint's names, attention.qkv read as
# view(..., 3, heads, head_dim), [q; k; v] as ComfyUI's comfy/ldm/ideogram4; examples/ideogram4/model_training/lora/
# *.sh target attention.qkv, attention.o, feed_forward.w1-3, adaln_modulation), its ACE-Step 1.5 (ace_step_dit.py
# AceStepDiTModel: the checkpoint's `decoder.` dropped by AceStepDiTModelStateDictConverter, so ComfyUI's decoder
# paths without `decoder.`; lora/*.sh target q/k/v/o_proj, gate/up/down_proj), its Krea 2 (krea2_dit.py
# SingleStreamDiT: the checkpoint's names; examples/krea2/model_training/lora/Krea-2-Raw.sh trains with
# --align_to_opensource_format, whose converter, diffsynth/utils/lora/krea2.py Krea2LoRAConverter.
# align_to_opensource_format, writes `transformer.` + its rename_dict's diffusers names: wq -> attn.to_q, txtmlp.1 ->
# txt_in.linear_1, tproj.1 -> time_mod_proj, last.linear -> final_layer.linear, ...)
DS_IG = "modelscope/DiffSynth-Studio diffsynth/models/ideogram4_dit.py + diffusion/logger.py ModelLogger.save_model"
DS_ACE = "modelscope/DiffSynth-Studio diffsynth/models/ace_step_dit.py + state_dict_converters/ace_step_dit.py"
DS_KREA = "modelscope/DiffSynth-Studio diffsynth/models/krea2_dit.py (PEFT on its own model, no prefix)"
DS_KREA_OPEN = "modelscope/DiffSynth-Studio diffsynth/utils/lora/krea2.py Krea2LoRAConverter.align_to_opensource_format"
DS_ANIMA = ("modelscope/DiffSynth-Studio diffsynth/models/anima_dit.py + diffusion/training_module.py "
            "auto_detect_lora_target_modules + logger.py ModelLogger.save_model")
QWEN_MUSUBI = "kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_qwen_image.py (lora_unet_ + diffusers' paths)"
QWEN_OT = OT.format(fmt="diffusers/_legacy/_kohya", model="QwenModel (ComfyUI's Qwen-Image keeps diffusers' names)")

NAMES = [
    # --- Ideogram 4 -------------------------------------------------------------------------------------------
    ("OneTrainer", "ideogram4", "transformer.layers.0.attention.to_q", PEFT, IG_QKV, (0, 0, IG_H), OT_IG),
    ("OneTrainer", "ideogram4", "transformer.layers.0.attention.to_v", PEFT, IG_QKV, (0, 2 * IG_H, IG_H), OT_IG),
    ("OneTrainer", "ideogram4", "transformer.layers.0.attention.to_out.0", PEFT, IG + "layers.0.attention.o.weight",
     None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.layers.0.feed_forward.w2", PEFT,
     IG + "layers.0.feed_forward.w2.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.layers.0.adaln_modulation", PEFT,
     IG + "layers.0.adaln_modulation.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.adaln_proj", PEFT, IG + "adaln_proj.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.input_proj", PEFT, IG + "input_proj.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.llm_cond_proj", PEFT, IG + "llm_cond_proj.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "transformer.t_embedding.mlp_in", PEFT, IG + "t_embedding.mlp_in.weight", None,
     OT_IG),
    ("OneTrainer", "ideogram4", "transformer.final_layer.adaln_modulation", PEFT,
     IG + "final_layer.adaln_modulation.weight", None, OT_IG),
    ("OneTrainer", "ideogram4", "lora_unet_layers_0_attention_qkv", LORA, IG_QKV, None, OT_IG_FUSED),
    ("OneTrainer", "ideogram4", "lora_unet_adaln_proj", LORA, IG + "adaln_proj.weight", None, OT_IG_FUSED),
    ("OneTrainer", "ideogram4", "layers.0.attention.o", PEFT, IG + "layers.0.attention.o.weight", None, OT_IG_FUSED),
    ("OneTrainer", "ideogram4", "diffusion_model.layers.0.attention.qkv", PEFT, IG_QKV, None, OT_IG_FUSED),
    # a OneTrainer DIFFUSERS file renamed by its user (Comfy-Org/ComfyUI#14477): `diffusion_model.` + diffusers names
    ("OneTrainer", "ideogram4", "diffusion_model.layers.0.attention.to_k", PEFT, IG_QKV, (0, IG_H, IG_H), OT_IG),
    ("musubi-tuner", "ideogram4", "lora_unet_layers_0_attention_qkv", LORA, IG_QKV, None, MUSUBI_IG),
    ("musubi-tuner", "ideogram4", "lora_unet_layers_0_feed_forward_w3", LORA, IG + "layers.0.feed_forward.w3.weight",
     None, MUSUBI_IG),
    ("SimpleTuner", "ideogram4", "transformer.layers.0.attention.qkv", PEFT, IG_QKV, None, ST_IG),
    ("SimpleTuner", "ideogram4", "transformer.layers.0.feed_forward.w1", PEFT, IG + "layers.0.feed_forward.w1.weight",
     None, ST_IG),
    ("SimpleTuner", "ideogram4", "lycoris_layers_0_attention_o", LORA, IG + "layers.0.attention.o.weight", None,
     ST_IG),
    ("ai-toolkit", "ideogram4", "diffusion_model.layers.0.attention.qkv", PEFT, IG_QKV, None,
     AIT.format("ideogram4/ideogram4.py (transformer. -> diffusion_model., src/transformer.py: qkv, o)")),
    ("diffusers", "ideogram4", "transformer.layers.0.attention.to_q", PEFT, IG_QKV, (0, 0, IG_H), DIFFUSERS_IG),
    ("DiffSynth-Studio", "ideogram4", "layers.0.attention.qkv", PEFT_DEFAULT, IG_QKV, None, DS_IG),
    ("DiffSynth-Studio", "ideogram4", "layers.0.feed_forward.w1", PEFT_DEFAULT, IG + "layers.0.feed_forward.w1.weight",
     None, DS_IG),
    ("DiffSynth-Studio", "ideogram4", "layers.0.adaln_modulation", PEFT_DEFAULT,
     IG + "layers.0.adaln_modulation.weight", None, DS_IG),
    # --- ERNIE-Image: ComfyUI's model keeps diffusers' names ----------------------------------------------------
    ("OneTrainer", "ernie", "transformer.layers.0.self_attention.to_q", PEFT,
     "diffusion_model.layers.0.self_attention.to_q.weight", None, OT_ERNIE),
    ("OneTrainer", "ernie", "transformer.layers.0.mlp.gate_proj", LORA,
     "diffusion_model.layers.0.mlp.gate_proj.weight", None, OT_ERNIE),  # LEGACY: unconverted, lora_down/up
    ("OneTrainer", "ernie", "lora_unet_layers_0_mlp_linear_fc2", LORA,
     "diffusion_model.layers.0.mlp.linear_fc2.weight", None, OT_ERNIE),
    ("OneTrainer", "ernie", "diffusion_model.layers.0.self_attention.to_out.0", PEFT,
     "diffusion_model.layers.0.self_attention.to_out.0.weight", None, OT_ERNIE),
    ("SimpleTuner", "ernie", "transformer.layers.0.self_attention.to_k", PEFT,
     "diffusion_model.layers.0.self_attention.to_k.weight", None, ST_ERNIE),
    ("SimpleTuner", "ernie", "lycoris_layers_0_self_attention_to_v", LORA,
     "diffusion_model.layers.0.self_attention.to_v.weight", None, ST_ERNIE),
    ("musubi-tuner", "ernie", "lora_unet_layers_0_self_attention_to_q", LORA,
     "diffusion_model.layers.0.self_attention.to_q.weight", None,
     "kohya-ss/musubi-tuner at 07f78ab1 src/musubi_tuner/networks/lora_ernie_image.py (ErnieImageSharedAdaLNBlock)"),
    ("ai-toolkit", "ernie", "diffusion_model.layers.0.mlp.up_proj", PEFT,
     "diffusion_model.layers.0.mlp.up_proj.weight", None, AIT.format("ernie_image/ernie_image.py")),
    ("DiffSynth-Studio", "ernie", "layers.0.self_attention.to_q", PEFT_DEFAULT,
     "diffusion_model.layers.0.self_attention.to_q.weight", None, DS_ERNIE),
    ("DiffSynth-Studio", "ernie", "layers.0.self_attention.to_out.0", PEFT_DEFAULT,
     "diffusion_model.layers.0.self_attention.to_out.0.weight", None, DS_ERNIE),
    # --- Anima --------------------------------------------------------------------------------------------------
    ("kohya sd-scripts", "anima", "lora_unet_blocks_0_self_attn_q_proj", LORA, AN + "self_attn.q_proj.weight", None,
     SD_ANIMA),
    ("kohya sd-scripts", "anima", "lora_unet_blocks_0_mlp_layer1", LORA, AN + "mlp.layer1.weight", None, SD_ANIMA),
    ("OneTrainer", "anima", "transformer.transformer_blocks.0.attn1.to_q", PEFT, AN + "self_attn.q_proj.weight", None,
     OT_ANIMA),
    ("OneTrainer", "anima", "transformer.transformer_blocks.0.norm2.linear_2", PEFT,
     AN + "adaln_modulation_cross_attn.2.weight", None, OT_ANIMA),
    ("OneTrainer", "anima", "transformer.time_embed.t_embedder.linear_1", PEFT,
     "diffusion_model.t_embedder.1.linear_1.weight", None, OT_ANIMA),
    ("OneTrainer", "anima", "lora_unet_blocks_0_cross_attn_output_proj", LORA, AN + "cross_attn.output_proj.weight",
     None, OT_ANIMA_DIT),
    ("OneTrainer", "anima", "diffusion_model.blocks.0.mlp.layer2", PEFT, AN + "mlp.layer2.weight", None,
     OT_ANIMA_DIT),
    ("OneTrainer", "anima", "net.blocks.0.self_attn.v_proj", PEFT, AN + "self_attn.v_proj.weight", None,
     OT_ANIMA_DIT),
    ("SimpleTuner", "anima", "transformer.transformer_blocks.0.attn2.to_k", PEFT, AN + "cross_attn.k_proj.weight",
     None, ST_ANIMA),
    ("SimpleTuner", "anima", "lycoris_transformer_blocks_0_attn1_to_out_0", LORA, AN + "self_attn.output_proj.weight",
     None, ST_ANIMA),
    ("ai-toolkit", "anima", "diffusion_model.blocks.0.self_attn.k_proj", PEFT, AN + "self_attn.k_proj.weight", None,
     AIT.format("anima/anima.py (_convert_diffusers_lora_key_to_comfy)")),
    ("ComfyUI trainer", "anima", "diffusion_model.blocks.0.cross_attn.q_proj", LORA, AN + "cross_attn.q_proj.weight",
     None, COMFY_TRAINER),
    ("DiffSynth-Studio", "anima", "blocks.0.self_attn.q_proj", PEFT_DEFAULT, AN + "self_attn.q_proj.weight", None,
     DS_ANIMA),
    ("DiffSynth-Studio", "anima", "blocks.0.cross_attn.v_proj", PEFT_DEFAULT, AN + "cross_attn.v_proj.weight", None,
     DS_ANIMA),
    ("DiffSynth-Studio", "anima", "blocks.0.mlp.layer2", PEFT_DEFAULT, AN + "mlp.layer2.weight", None, DS_ANIMA),
    ("DiffSynth-Studio", "anima", "llm_adapter.blocks.0.cross_attn.o_proj", PEFT_DEFAULT,
     "diffusion_model.llm_adapter.blocks.0.cross_attn.o_proj.weight", None, DS_ANIMA),
    ("DiffSynth-Studio", "anima", "llm_adapter.blocks.0.mlp.0", PEFT_DEFAULT,
     "diffusion_model.llm_adapter.blocks.0.mlp.0.weight", None, DS_ANIMA),
    # --- ACE-Step 1.5: its adapters name the decoder's modules --------------------------------------------------
    ("ACE-Step", "acestep15", "base_model.model.layers.0.self_attn.q_proj", PEFT,
     "diffusion_model.decoder.layers.0.self_attn.q_proj.weight", None, ACE_OFFICIAL),
    ("SimpleTuner", "acestep15", "lycoris_layers_0_cross_attn_k_proj", LORA,
     "diffusion_model.decoder.layers.0.cross_attn.k_proj.weight", None, ACE_ST),
    ("DiffSynth-Studio", "acestep15", "layers.0.self_attn.q_proj", PEFT_DEFAULT,
     "diffusion_model.decoder.layers.0.self_attn.q_proj.weight", None, DS_ACE),
    ("DiffSynth-Studio", "acestep15", "layers.0.mlp.down_proj", PEFT_DEFAULT,
     "diffusion_model.decoder.layers.0.mlp.down_proj.weight", None, DS_ACE),
    # --- Qwen-Image (and -Edit: the same model class) -----------------------------------------------------------
    ("musubi-tuner", "qwen_image", "lora_unet_transformer_blocks_0_attn_to_q", LORA,
     "diffusion_model.transformer_blocks.0.attn.to_q.weight", None, QWEN_MUSUBI),
    ("musubi-tuner", "qwen_image", "lora_unet_transformer_blocks_0_img_mlp_net_0_proj", LORA,
     "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.weight", None, QWEN_MUSUBI),
    ("OneTrainer", "qwen_image", "transformer.transformer_blocks.0.attn.add_k_proj", PEFT,
     "diffusion_model.transformer_blocks.0.attn.add_k_proj.weight", None, QWEN_OT),
    ("SimpleTuner", "qwen_image", "lycoris_transformer_blocks_0_attn_to_k", LORA,
     "diffusion_model.transformer_blocks.0.attn.to_k.weight", None,
     ST + " + helpers/models/qwen_image/model.py (diffusers' QwenImageTransformer2DModel, DEFAULT_LORA_TARGET)"),
    ("DiffSynth-Studio", "qwen_image", "transformer_blocks.0.attn.to_out.0", PEFT_DEFAULT,
     "diffusion_model.transformer_blocks.0.attn.to_out.0.weight", None,
     "modelscope/DiffSynth-Studio (PEFT state dict of its Qwen-Image DiT, diffusers' names, no prefix)"),
    ("ai-toolkit", "qwen_image", "diffusion_model.transformer_blocks.0.img_mod.1", PEFT,
     "diffusion_model.transformer_blocks.0.img_mod.1.weight", None, AIT.format("qwen_image/qwen_image.py (transformer. -> diffusion_model.)")),
    # --- LongCat-Image: Flux's blocks, ComfyUI's Flux map -------------------------------------------------------
    ("SimpleTuner", "longcat", "transformer.transformer_blocks.0.attn.to_k", PEFT,
     "diffusion_model.double_blocks.0.img_attn.qkv.weight", (0, 3072, 3072), ST_LONGCAT),
    ("SimpleTuner", "longcat", "lycoris_single_transformer_blocks_0_attn_to_v", LORA,
     "diffusion_model.single_blocks.0.linear1.weight", (0, 6144, 3072), ST_LONGCAT),
    # --- HunyuanImage 2.1 and its refiner -----------------------------------------------------------------------
    ("kohya sd-scripts", "hunyuan_image21", "lora_unet_double_blocks_0_img_mlp_fc1", LORA,
     "diffusion_model.double_blocks.0.img_mlp.0.weight", None, SD_HI),
    ("kohya sd-scripts", "hunyuan_image21", "lora_unet_double_blocks_0_txt_mod_linear", LORA,
     "diffusion_model.double_blocks.0.txt_mod.lin.weight", None, SD_HI),
    ("kohya sd-scripts", "hunyuan_image21", "lora_unet_single_blocks_0_modulation_linear", LORA,
     "diffusion_model.single_blocks.0.modulation.lin.weight", None, SD_HI),
    ("kohya sd-scripts", "hunyuan_image21", "lora_unet_double_blocks_0_img_attn_qkv", LORA,
     "diffusion_model.double_blocks.0.img_attn.qkv.weight", None, SD_HI),
    ("kohya sd-scripts", "hunyuan_image21", "lora_unet_single_blocks_0_linear1", LORA,
     "diffusion_model.single_blocks.0.linear1.weight", None, SD_HI),
    ("sd-scripts converted", "hunyuan_image21", "lora_unet_double_blocks_0_img_mlp_2", LORA,
     "diffusion_model.double_blocks.0.img_mlp.2.weight", None, SD_HI_COMFY),
    ("ComfyUI trainer", "hunyuan_image21", "diffusion_model.byt5_in.fc1", LORA, "diffusion_model.byt5_in.fc1.weight",
     None, COMFY_TRAINER),
    ("kohya sd-scripts", "hunyuan_image21_refiner", "lora_unet_double_blocks_0_txt_mlp_fc2", LORA,
     "diffusion_model.double_blocks.0.txt_mlp.2.weight", None, SD_HI),
    ("ComfyUI trainer", "hunyuan_image21_refiner", "diffusion_model.guidance_in.in_layer", LORA,
     "diffusion_model.guidance_in.in_layer.weight", None, COMFY_TRAINER),
    # --- HiDream-O1 ---------------------------------------------------------------------------------------------
    ("ComfyUI 0.38 map", "hidream_o1", "model.language_model.layers.0.self_attn.q_proj", PEFT,
     "diffusion_model.language_model.layers.0.self_attn.q_proj.weight", None, COMFY_038_HIDREAM),
    ("musubi-tuner", "hidream_o1", "lora_unet_model_language_model_layers_0_mlp_down_proj", LORA,
     "diffusion_model.language_model.layers.0.mlp.down_proj.weight", None, MUSUBI_HIDREAM),
    ("musubi-tuner", "hidream_o1", "lora_unet_model_visual_blocks_0_attn_qkv", LORA,
     "diffusion_model.visual.blocks.0.attn.qkv.weight", None, MUSUBI_HIDREAM),
    ("ComfyUI trainer", "hidream_o1", "diffusion_model.language_model.layers.0.self_attn.k_proj", LORA,
     "diffusion_model.language_model.layers.0.self_attn.k_proj.weight", None, COMFY_TRAINER),
    # --- Krea 2 (unfused q/k/v in every format) -----------------------------------------------------------------
    ("OneTrainer", "krea2", "transformer.transformer_blocks.0.attn.to_q", PEFT,
     "diffusion_model.blocks.0.attn.wq.weight", None, OT.format(fmt="diffusers", model="Krea2Model")),
    ("OneTrainer", "krea2", "lora_unet_blocks_0_attn_wk", LORA, "diffusion_model.blocks.0.attn.wk.weight", None,
     OT.format(fmt="kohya", model="Krea2Model (diffusers_to_original: to_k -> attn.wk)")),
    ("OneTrainer", "krea2", "diffusion_model.blocks.0.mlp.down", PEFT, "diffusion_model.blocks.0.mlp.down.weight",
     None, OT.format(fmt="comfy", model="Krea2Model")),
    ("DiffSynth-Studio", "krea2", "blocks.0.attn.wq", PEFT_DEFAULT, "diffusion_model.blocks.0.attn.wq.weight", None,
     DS_KREA),
    ("DiffSynth-Studio", "krea2", "txtfusion.refiner_blocks.0.mlp.gate", PEFT_DEFAULT,
     "diffusion_model.txtfusion.refiner_blocks.0.mlp.gate.weight", None, DS_KREA),
    ("DiffSynth-Studio", "krea2", "transformer.transformer_blocks.0.attn.to_gate", PEFT,
     "diffusion_model.blocks.0.attn.gate.weight", None, DS_KREA_OPEN),
    ("DiffSynth-Studio", "krea2", "transformer.txt_in.linear_1", PEFT, "diffusion_model.txtmlp.1.weight", None,
     DS_KREA_OPEN),
    ("DiffSynth-Studio", "krea2", "transformer.time_mod_proj", PEFT, "diffusion_model.tproj.1.weight", None,
     DS_KREA_OPEN),
    ("DiffSynth-Studio", "krea2", "transformer.final_layer.linear", PEFT, "diffusion_model.last.linear.weight", None,
     DS_KREA_OPEN),
    ("DiffSynth-Studio", "krea2", "transformer.text_fusion.layerwise_blocks.0.ff.up", PEFT,
     "diffusion_model.txtfusion.layerwise_blocks.0.mlp.up.weight", None, DS_KREA_OPEN),
    ("musubi-tuner", "krea2", "lora_unet_blocks_0_attn_wv", LORA, "diffusion_model.blocks.0.attn.wv.weight", None,
     "kohya-ss/musubi-tuner networks/lora_krea2.py (lora_unet_ + krea2/krea2_mmdit.py: blocks.N.attn.wq/wk/wv/wo)"),
    # --- Flux.2 (trainers the README marked "not checked") -------------------------------------------------------
    ("musubi-tuner", "flux2", "lora_unet_double_blocks_0_img_attn_qkv", LORA,
     "diffusion_model.double_blocks.0.img_attn.qkv.weight", None,
     "kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_flux_2.py (lora_unet_ + BFL's names)"),
    ("OneTrainer", "flux2", "transformer.transformer_blocks.0.attn.to_k", PEFT,
     "diffusion_model.double_blocks.0.img_attn.qkv.weight", (0, 6144, 6144),
     OT.format(fmt="diffusers/_legacy", model="Flux2Model (q/k/v split)")),
    ("OneTrainer", "flux2", "transformer.double_stream_modulation_txt.linear", LORA,
     "diffusion_model.double_stream_modulation_txt.lin.weight", None,
     OT.format(fmt="legacy", model="Flux2Model (canonical diffusers names, lora_down/up)")),
    ("OneTrainer", "flux2", "lora_unet_single_blocks_0_linear1", LORA, "diffusion_model.single_blocks.0.linear1.weight",
     None, OT.format(fmt="kohya", model="Flux2Model (diffusers_to_original)")),
    ("OneTrainer", "flux2", "diffusion_model.double_blocks.0.txt_attn.qkv", PEFT,
     "diffusion_model.double_blocks.0.txt_attn.qkv.weight", None, OT.format(fmt="comfy", model="Flux2Model")),
    ("ai-toolkit", "flux2", "diffusion_model.double_blocks.0.img_attn.qkv", PEFT,
     "diffusion_model.double_blocks.0.img_attn.qkv.weight", None,
     AIT.format("flux2/flux2_model.py (transformer. -> diffusion_model., src/model.py: BFL's names)")),
    ("DiffSynth-Studio", "flux2", "transformer_blocks.0.attn.add_q_proj", PEFT_DEFAULT,
     "diffusion_model.double_blocks.0.txt_attn.qkv.weight", (0, 0, 6144),
     "modelscope/DiffSynth-Studio diffsynth/models/flux2_dit.py (diffusers' Flux.2 names, no prefix)"),
    ("DiffSynth-Studio", "flux2", "single_transformer_blocks.0.attn.to_out", PEFT_DEFAULT,
     "diffusion_model.single_blocks.0.linear2.weight", None,
     "modelscope/DiffSynth-Studio diffsynth/models/flux2_dit.py (diffusers' Flux.2 names, no prefix)"),
]
EXPECTED_MISSES: dict[tuple[str, str], str] = {}


def _params() -> list:
    params = []
    for entry in NAMES:
        trainer, arch, name = entry[:3]
        marks = []
        if not hasattr(supported, CONFIGS[arch][0]):
            marks.append(pytest.mark.skip(reason=f"this ComfyUI has no supported_models.{CONFIGS[arch][0]}"))
        reason = EXPECTED_MISSES.get((arch, name))
        if reason:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        params.append(pytest.param(*entry, id=f"{trainer}-{arch}-{name}", marks=marks))
    return params


@pytest.fixture(scope="module")
def meta_models():
    """ComfyUI's own model classes on the meta device, built on first use."""
    built = {}

    class Models(dict):
        def __missing__(self, arch):
            cls, config = CONFIGS[arch]
            if arch in PARAMS:  # fields an older ComfyUI's dataclass lacks are left out, as the derive script does
                built[arch] = derive.meta_model(derive.Arch(arch, cls, config, "", params=PARAMS[arch]))
            else:
                device = "cpu" if arch == "acestep15" else "meta"
                built[arch] = getattr(supported, cls)(dict(config)).get_model({}, "", device=device)
            return built[arch]

    return Models()


@pytest.mark.parametrize("trainer,arch,name,suffixes,target,rows,source", _params())
def test_trainer_names_reach_their_weight(trainer, arch, name, suffixes, target, rows, source, meta_models):
    report = _report(arch, name, suffixes, target, rows, None, meta_models)
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    module_key = next(iter(report.applied))
    assert report.applied == {module_key: target}
    assert report.targets[module_key].target.offset == Offset.from_comfy(rows)


# --- the "made for" verdict ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefixes,family", [
    # OneTrainer's DIFFUSERS names (Comfy-Org/ComfyUI#14477's file): the q/k/v are Z-Image's names, at Ideogram's width
    ({"transformer.layers.0.attention.to_q": IG_H, "transformer.layers.0.attention.to_out.0": IG_H}, "Ideogram 4"),
    ({"transformer.adaln_proj": IG_H}, "Ideogram 4"),
    ({"lora_unet_layers_0_attention_o": IG_H}, "Ideogram 4"),  # musubi-tuner, OneTrainer KOHYA
    ({"diffusion_model.layers.0.adaln_modulation": 512}, "Ideogram 4"),  # ai-toolkit, OneTrainer COMFY
    ({"diffusion_model.layers.0.attention.qkv": IG_H}, "Ideogram 4"),
    # Z-Image (3840) and Lumina 2 (2304) keep their verdict
    ({"transformer.layers.0.attention.to_q": 3840}, "Z-Image / Lumina 2"),
    ({"diffusion_model.layers.0.attention.qkv": 2304, "diffusion_model.layers.0.adaLN_modulation.0": 256},
     "Z-Image / Lumina 2"),
])
def test_ideogram4_files_are_not_taken_for_z_image(prefixes, family):
    assert infer_family(prefixes) == family


def test_the_verdict_names_ideogram4_not_z_image(meta_models):
    """OneTrainer's Ideogram 4 file (#14477: split q/k/v in Z-Image's names): where it does not fit (here on ComfyUI's
    Z-Image, nothing applies) the verdict says Ideogram 4, and on ComfyUI's Ideogram 4 it gives none."""
    from lycoris_nodes.lycoris_core import parse_state_dict
    from lycoris_nodes.nodes.glue.apply import build_patches
    from lycoris_nodes.nodes.glue.coverage import family_verdict
    from lycoris_nodes.nodes.glue.keymap import lora_key_map, model_shapes
    zimage = supported.ZImage(dict(ZIMAGE_CONFIG)).get_model({}, "", device="meta")
    sd = {}
    for name, out in (("transformer.layers.0.attention.to_q", IG_H), ("transformer.layers.0.attention.to_out.0", IG_H),
                      ("transformer.adaln_proj", 512)):
        sd[f"{name}.lora_A.weight"] = torch.zeros(2, IG_H)
        sd[f"{name}.lora_B.weight"] = torch.zeros(out, 2)
    lfile = parse_state_dict(sd, "ideogram4.safetensors")
    report = build_patches(lfile, lora_key_map(zimage, is_clip=False), {"model": model_shapes(zimage)}, False)[1]
    assert report.applied == {}
    assert family_verdict(lfile, report, "ZImage") == "This file looks made for Ideogram 4, not for this ZImage."
    assert family_verdict(lfile, report, "Ideogram4") == ""
