"""The module names other trainers write, for SD1.5, SDXL, Flux and Wan, through our loader's key map.

Each fixture is a small state dict with the exact names one trainer's saver writes for a few representative modules
(its source is cited at each entry), shaped from the ComfyUI model it is meant for: the tiny SD1.5 checkpoint (with
its CLIP), and SDXL, Flux and Wan models ComfyUI builds on the meta device. Each must land on the right weight
(and, for Flux's fused qkv, the right rows), or the test records why it does not.

The text encoders of SDXL (CLIP-L, CLIP-G) and Flux (CLIP-L, T5-XXL) are ComfyUI's own classes on the meta device too.
OneTrainer writes no Wan LoRA. The video and newest families (Wan I2V, HunyuanVideo, LTX-Video, Z-Image) are
ComfyUI's own classes on the meta device at their released widths (no memory), one or two blocks deep; each trainer's
rule is cited from its save code (the repository snapshots read are named at each source string).
"""

import dataclasses

import comfy.sdxl_clip
import comfy.supported_models as supported
import comfy.text_encoders.flux
import pytest
import test_nodes
import torch
from comfy.ldm.flux.model import FluxParams
from comfy.ldm.hunyuan_video.model import HunyuanVideoParams
from derive_names import derive
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.lycoris_core.keys import split_key
from lycoris_nodes.nodes.glue.apply import build_patches, map_file
from lycoris_nodes.nodes.glue.keymap import lora_key_map, model_shapes
from lycoris_nodes.nodes.glue.patch_key import Offset

sd15 = test_nodes.sd15  # fixture

OMI_IMG_IN = ("OneTrainer's Flux OMI key set writes x_embedder as `img_in.proj`, a module BFL's Flux (and ComfyUI's) does "
              "not have: its img_in is one Linear, `img_in.weight`")

# ComfyUI's own SDXL UNet config (comfy/model_detection.py, unet_config_from_diffusers_unet's SDXL entry)
SDXL_CONFIG = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
               "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
               "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
               "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
               "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
               "use_temporal_attention": False, "use_temporal_resblock": False}
FLUX_CONFIG = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
               "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
               "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
WAN_CONFIG = {"image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 32,
              "num_heads": 4, "num_layers": 2, "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2),
              "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
# mlp_ratio 4 as in Flux.1: ComfyUI's flux_to_diffusers places proj_mlp at rows 3h…7h whatever the config says
if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)}:
    FLUX_CONFIG["txt_ids_dims"] = []  # 0.33's Flux also takes the text position-id layout; 0.3.75's has no such field
WAN_I2V_CONFIG = {**WAN_CONFIG, "model_type": "i2v", "in_dim": 36}
# Released widths (on the meta device): diffusers' HunyuanVideo converter splits linear1 at 3072 rows, Z-Image's
# fused qkv is 3 x 3840 rows.
HV_CONFIG = {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16,
             "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 4096,
             "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 1, "depth_single_blocks": 1,
             "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": True, "use_cond_type_embedding": False,
             "vision_in_dim": None, "meanflow_sum": False}
if "meanflow_sum" not in {f.name for f in dataclasses.fields(HunyuanVideoParams)}:
    del HV_CONFIG["meanflow_sum"]  # 0.3.75's HunyuanVideo takes no meanflow_sum
LTXV_CONFIG = {"image_model": "ltxv", "num_layers": 1, "attention_head_dim": 8, "cross_attention_dim": 64,
               "num_attention_heads": 4, "in_channels": 16, "out_channels": 16, "caption_channels": 32}
LTX2_CONFIG = {**LTXV_CONFIG, "image_model": "ltxav"}
# released widths, on the meta device, as scripts/derive_diffusers_names.py builds them
FLUX2_CONFIG, CHROMA_CONFIG = derive._flux2(depth=1, depth_single_blocks=1), derive._chroma(depth=1)
COSMOS_CONFIG = derive._cosmos_predict2(num_blocks=1)
# ComfyUI's detection of Mochi (model_detection.py: one released size), 2 blocks deep
MOCHI_CONFIG = {"image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 24, "hidden_size_x": 3072,
                "hidden_size_y": 1536, "mlp_ratio_x": 4.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
                "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
                "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
                "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 4096, "t5_token_length": 256,
                "rope_theta": 10000.0}
ZIMAGE_CONFIG = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 3840, "cap_feat_dim": 2560,
                 "n_layers": 1, "qk_norm": True, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48],
                 "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
                 "z_image_modulation": True, "time_scale": 1000.0}
HV = HV_CONFIG["hidden_size"]
# HunyuanVideo 1.5 (ComfyUI's HunyuanVideo15: HunyuanVideo's blocks at 2048, no single blocks), as detection sets it
HV15_CONFIG = {**HV_CONFIG, "in_channels": 65, "patch_size": [1, 1, 1], "out_channels": 32, "vec_in_dim": None,
               "context_in_dim": 3584, "hidden_size": 2048, "num_heads": 16, "depth_single_blocks": 0, "byt5": True,
               "guidance_embed": False, "use_cond_type_embedding": True, "vision_in_dim": 1152}
if "meanflow_sum" in HV_CONFIG:
    HV15_CONFIG["meanflow_sum"] = True
HIDDEN = FLUX_CONFIG["hidden_size"]
MLP = int(HIDDEN * FLUX_CONFIG["mlp_ratio"])

LORA = ("lora_down.weight", "lora_up.weight")  # kohya / LyCORIS / OneTrainer legacy
PEFT = ("lora_A.weight", "lora_B.weight")  # diffusers / PEFT / ai-toolkit

SD15_TO_Q = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
SD15_TE_Q = "clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
SDXL_TO_Q = "diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"
FLUX_QKV = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
FLUX_LINEAR1 = "diffusion_model.single_blocks.0.linear1.weight"
WAN_Q = "diffusion_model.blocks.0.self_attn.q.weight"
WAN_FFN0 = "diffusion_model.blocks.0.ffn.0.weight"
FLUX_Q_ROWS = (0, 0, HIDDEN)  # to_q is the first third of the fused qkv (and the first part of linear1)
FLUX_MLP_ROWS = (0, 3 * HIDDEN, MLP)  # linear1 is q, k, v, then the MLP's input projection
SDXL_TE1_Q = "clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
SDXL_TE2_Q = "clip_g.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
FLUX_T5_Q = "t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"
WAN_K_IMG = "diffusion_model.blocks.0.cross_attn.k_img.weight"
HV_QKV = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
HV_TXT_QKV = "diffusion_model.double_blocks.0.txt_attn.qkv.weight"
HV_LINEAR1 = "diffusion_model.single_blocks.0.linear1.weight"
LTXV_Q = "diffusion_model.transformer_blocks.0.attn1.to_q.weight"
ZI_QKV = "diffusion_model.layers.0.attention.qkv.weight"
ZI_DIM = ZIMAGE_CONFIG["dim"]

# (trainer, architecture, module name as written, suffixes, target weight, rows or None, source of the name style)
ONETRAINER = "Nerogar/OneTrainer modules/modelSaver/mixin/LoRASaverMixin.py (convert_to_legacy_diffusers)"
SIMPLETUNER_PEFT = "bghira/SimpleTuner helpers/training/save_hooks.py _save_lora (diffusers save_lora_weights)"
SIMPLETUNER_LYCORIS = "bghira/SimpleTuner helpers/training/save_hooks.py _save_lycoris (LyCORIS wrapper, lycoris_)"
# ai-toolkit's LoRASpecialNetwork (ostris/ai-toolkit toolkit/lora_special.py create_modules, L463-502 at 27a03a9):
# name = prefix + the module's path in the diffusers model, dots -> "_" (kohya style: lora_unet, lora_te, lora_te1/2),
# or kept as dots under `transformer` where peft_format is forced (Flux, SD3, Lumina2, other transformers, L423-433);
# network_mixins.py get_state_dict then renames lora_down/up -> lora_A/B and drops alpha (L607-622). SD1.5/SDXL use
# no key map (get_keymap looks for stable_diffusion_locon_*.json, which the repository does not have).
AI_TOOLKIT = "ostris/ai-toolkit toolkit/lora_special.py create_modules + network_mixins.py get_state_dict"
AI_TOOLKIT_WAN = "ostris/ai-toolkit Wan 2.1 model: convert_lora_weights_before_save = convert_to_original"
# OneTrainer's OMI format (enable_omi_format): LoRASaverMixin.__save_safetensors calls convert_to_omi
# (modules/util/convert/lora/convert_lora_util.py: a key set's omi_prefix replaces its diffusers_prefix, the rest of
# the key is kept), with the key sets of modules/util/convert/lora/convert_sd_lora.py (convert_sd_lora_key_sets:
# "unet" <-> "lora_unet", "clip_l" <-> "lora_te"; __map_unet_down_blocks "1.1" <-> "0.attentions.0"),
# convert_sdxl_lora.py ("clip_l"/"clip_g" <-> "lora_te1"/"lora_te2"; "label_emb.0.0" <-> "add_embedding.linear_1"),
# convert_flux_lora.py (__map_transformer "transformer" <-> "lora_transformer", "img_in.proj" <-> "x_embedder";
# __map_double_transformer_block "img_attn.qkv.0" <-> "attn.to_q", "img_attn.proj" <-> "attn.to_out.0";
# __map_single_transformer_block "linear1.3" <-> "proj_mlp", "linear2" <-> "proj_out"; map_clip, map_t5).
OT_OMI = "Nerogar/OneTrainer modules/util/convert/lora/convert_{sd,sdxl,flux}_lora.py key sets (convert_to_omi)"
MUSUBI = "kohya-ss/musubi-tuner networks/lora_wan.py, lora.py (prefix lora_unet, the model's own module names)"
SD_SCRIPTS = "kohya-ss/sd-scripts networks/lora.py (lora_unet_, SDXL U-Net in its original names)"
# DiffSynth-Studio (modelscope/DiffSynth-Studio at fed7b18f, diffsynth/trainers + diffsynth/models/wan_video_dit.py,
# z_image_dit.py): PEFT's state dict of its own model, no prefix, adapter name kept (`.lora_A.default.weight`).
DIFFSYNTH = "modelscope/DiffSynth-Studio (PEFT state dict of its own model: original Wan / Z-Image paths, no prefix)"
PEFT_DEFAULT = ("lora_A.default.weight", "lora_B.default.weight")
# Its Flux keeps DiffSynth's own names (diffsynth/models/flux_dit.py) unless trained with --align_to_opensource_format;
# the map comes from its converter (diffsynth/utils/state_dict_converters/flux_dit.py), see diffusers_names.json.
DIFFSYNTH_FLUX = "modelscope/DiffSynth-Studio FluxDiT names (blocks.N.attn.a_to_qkv, single_blocks.N.to_qkv_mlp)"
MUSUBI_HV = ("kohya-ss/musubi-tuner src/musubi_tuner/networks/lora.py (HunyuanVideo: Tencent's names, "
             "hunyuan_model/models.py: img_attn_qkv, img_mlp.fc1)")
MUSUBI_ZI = ("kohya-ss/musubi-tuner src/musubi_tuner/networks/lora_zimage.py (zimage/zimage_model.py: split "
             "attention.to_q/to_k/to_v, to_out.0, feed_forward.w1/w2/w3)")
# OneTrainer (Nerogar/OneTrainer at 23df3832) HunyuanVideo: LEGACY = `lora_transformer_` + diffusers path underscored,
# COMFY (its preset's default) = `diffusion_model.` + Tencent names (modules/model/HunyuanVideoModel.py
# diffusers_to_original).
OT_HV = "Nerogar/OneTrainer modules/modelSaver/mixin/LoRASaverMixin.py (HunyuanVideo LEGACY / COMFY formats)"

NAMES = [
    ("OneTrainer", "sd15", "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SD15_TO_Q,
     None, ONETRAINER),
    ("OneTrainer", "sd15", "lora_te_text_model_encoder_layers_0_self_attn_q_proj", LORA, SD15_TE_Q, None, ONETRAINER),
    ("SimpleTuner", "sd15", "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", PEFT, SD15_TO_Q, None,
     SIMPLETUNER_PEFT),
    ("SimpleTuner", "sd15", "text_encoder.text_model.encoder.layers.0.self_attn.q_proj", PEFT, SD15_TE_Q, None,
     SIMPLETUNER_PEFT),
    ("SimpleTuner", "sd15", "lycoris_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SD15_TO_Q,
     None, SIMPLETUNER_LYCORIS),
    ("OneTrainer", "sdxl", "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SDXL_TO_Q,
     None, ONETRAINER),
    ("kohya sd-scripts", "sdxl", "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", LORA, SDXL_TO_Q, None,
     SD_SCRIPTS),
    ("SimpleTuner", "sdxl", "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", PEFT, SDXL_TO_Q, None,
     SIMPLETUNER_PEFT),
    ("SimpleTuner", "sdxl", "lycoris_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SDXL_TO_Q,
     None, SIMPLETUNER_LYCORIS),
    ("OneTrainer", "flux", "lora_transformer_transformer_blocks_0_attn_to_q", LORA, FLUX_QKV, FLUX_Q_ROWS, ONETRAINER),
    ("OneTrainer", "flux", "lora_transformer_single_transformer_blocks_0_attn_to_q", LORA, FLUX_LINEAR1, FLUX_Q_ROWS,
     ONETRAINER),
    ("SimpleTuner", "flux", "transformer.transformer_blocks.0.attn.to_q", PEFT, FLUX_QKV, FLUX_Q_ROWS,
     SIMPLETUNER_PEFT),
    ("SimpleTuner", "flux", "lycoris_transformer_blocks_0_attn_to_q", LORA, FLUX_QKV, FLUX_Q_ROWS, SIMPLETUNER_LYCORIS),
    ("musubi-tuner", "flux", "lora_unet_double_blocks_0_img_attn_qkv", LORA, FLUX_QKV, None, MUSUBI),
    ("ai-toolkit", "wan", "diffusion_model.blocks.0.self_attn.q", PEFT, WAN_Q, None, AI_TOOLKIT_WAN),
    ("ai-toolkit", "wan", "diffusion_model.blocks.0.ffn.0", PEFT, WAN_FFN0, None, AI_TOOLKIT_WAN),
    ("musubi-tuner", "wan", "lora_unet_blocks_0_self_attn_q", LORA, WAN_Q, None, MUSUBI),
    ("musubi-tuner", "wan", "lora_unet_blocks_0_ffn_0", LORA, WAN_FFN0, None, MUSUBI),
    ("SimpleTuner", "wan", "transformer.blocks.0.attn1.to_q", PEFT, WAN_Q, None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "wan", "lycoris_blocks_0_attn1_to_q", LORA, WAN_Q, None, SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "wan", "transformer.blocks.0.ffn.net.0.proj", PEFT, WAN_FFN0, None, SIMPLETUNER_PEFT),
    ("PEFT save_pretrained", "wan", "base_model.model.blocks.0.attn1.to_out.0", PEFT,
     "diffusion_model.blocks.0.self_attn.o.weight", None, SIMPLETUNER_PEFT),
    ("DiffSynth-Studio", "wan", "blocks.0.self_attn.q", PEFT_DEFAULT, WAN_Q, None, DIFFSYNTH),
    ("DiffSynth-Studio", "wan", "blocks.0.ffn.0", PEFT_DEFAULT, WAN_FFN0, None, DIFFSYNTH),
    ("SimpleTuner", "wan_i2v", "transformer.blocks.0.attn2.add_k_proj", PEFT, WAN_K_IMG, None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "wan_i2v", "lycoris_blocks_0_attn2_add_k_proj", LORA, WAN_K_IMG, None, SIMPLETUNER_LYCORIS),
    ("musubi-tuner", "wan_i2v", "lora_unet_blocks_0_cross_attn_k_img", LORA, WAN_K_IMG, None, MUSUBI),
    ("SimpleTuner", "hunyuan_video", "transformer.transformer_blocks.0.attn.to_q", PEFT, HV_QKV, (0, 0, HV),
     SIMPLETUNER_PEFT),
    ("SimpleTuner", "hunyuan_video", "transformer.transformer_blocks.0.attn.add_k_proj", PEFT, HV_TXT_QKV,
     (0, HV, HV), SIMPLETUNER_PEFT),
    ("SimpleTuner", "hunyuan_video", "transformer.single_transformer_blocks.0.proj_mlp", PEFT, HV_LINEAR1,
     (0, 3 * HV, 4 * HV), SIMPLETUNER_PEFT),
    ("SimpleTuner", "hunyuan_video", "transformer.transformer_blocks.0.ff.net.0.proj", PEFT,
     "diffusion_model.double_blocks.0.img_mlp.0.weight", None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "hunyuan_video", "lycoris_transformer_blocks_0_attn_to_v", LORA, HV_QKV, (0, 2 * HV, HV),
     SIMPLETUNER_LYCORIS),
    ("OneTrainer", "hunyuan_video", "lora_transformer_single_transformer_blocks_0_attn_to_k", LORA, HV_LINEAR1,
     (0, HV, HV), OT_HV),
    ("OneTrainer", "hunyuan_video", "diffusion_model.double_blocks.0.img_attn_qkv", PEFT, HV_QKV, None, OT_HV),
    ("musubi-tuner", "hunyuan_video", "lora_unet_double_blocks_0_img_mlp_fc1", LORA,
     "diffusion_model.double_blocks.0.img_mlp.0.weight", None, MUSUBI_HV),
    ("musubi-tuner", "hunyuan_video", "lora_unet_double_blocks_0_txt_mlp_fc2", LORA,
     "diffusion_model.double_blocks.0.txt_mlp.2.weight", None, MUSUBI_HV),
    ("musubi-tuner", "hunyuan_video", "lora_unet_double_blocks_0_img_attn_qkv", LORA, HV_QKV, None, MUSUBI_HV),
    ("SimpleTuner", "ltxv", "transformer.transformer_blocks.0.attn1.to_q", PEFT, LTXV_Q, None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "ltxv", "lycoris_transformer_blocks_0_attn1_to_q", LORA, LTXV_Q, None, SIMPLETUNER_LYCORIS),
    ("musubi-tuner", "zimage", "lora_unet_layers_0_attention_to_q", LORA, ZI_QKV, (0, 0, ZI_DIM), MUSUBI_ZI),
    ("musubi-tuner", "zimage", "lora_unet_layers_0_attention_to_v", LORA, ZI_QKV, (0, 2 * ZI_DIM, ZI_DIM), MUSUBI_ZI),
    ("musubi-tuner", "zimage", "lora_unet_layers_0_attention_to_out_0", LORA,
     "diffusion_model.layers.0.attention.out.weight", None, MUSUBI_ZI),
    ("musubi-tuner", "zimage", "lora_unet_layers_0_feed_forward_w2", LORA,
     "diffusion_model.layers.0.feed_forward.w2.weight", None, MUSUBI_ZI),
    ("DiffSynth-Studio", "zimage", "layers.0.attention.to_k", PEFT_DEFAULT, ZI_QKV, (0, ZI_DIM, ZI_DIM), DIFFSYNTH),
    ("DiffSynth-Studio", "flux", "blocks.0.attn.a_to_qkv", PEFT_DEFAULT, FLUX_QKV, None, DIFFSYNTH_FLUX),
    ("DiffSynth-Studio", "flux", "single_blocks.1.to_qkv_mlp", PEFT_DEFAULT,
     "diffusion_model.single_blocks.1.linear1.weight", None, DIFFSYNTH_FLUX),
    ("DiffSynth-Studio", "flux", "blocks.1.ff_b.2", PEFT_DEFAULT, "diffusion_model.double_blocks.1.txt_mlp.2.weight",
     None, DIFFSYNTH_FLUX),
    ("SimpleTuner", "zimage", "transformer.layers.0.attention.to_q", PEFT, ZI_QKV, (0, 0, ZI_DIM), SIMPLETUNER_PEFT),
    ("SimpleTuner", "zimage", "lycoris_layers_0_attention_to_k", LORA, ZI_QKV, (0, ZI_DIM, ZI_DIM),
     SIMPLETUNER_LYCORIS),
    ("OneTrainer", "zimage", "diffusion_model.layers.0.attention.to_v", PEFT, ZI_QKV, (0, 2 * ZI_DIM, ZI_DIM),
     "Nerogar/OneTrainer LoRASaverMixin COMFY format (Z-Image: diffusion_model. + its diffusers names)"),
    ("ai-toolkit", "zimage", "diffusion_model.layers.0.feed_forward.w1", PEFT,
     "diffusion_model.layers.0.feed_forward.w1.weight", None,
     "ostris/ai-toolkit extensions_built_in/diffusion_models/z_image/z_image.py (transformer. -> diffusion_model.)"),
    ("SimpleTuner", "ltx2", "transformer.transformer_blocks.0.audio_attn1.to_q", PEFT,
     "diffusion_model.transformer_blocks.0.audio_attn1.to_q.weight", None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "ltx2", "lycoris_transformer_blocks_0_video_to_audio_attn_to_k", LORA,
     "diffusion_model.transformer_blocks.0.video_to_audio_attn.to_k.weight", None, SIMPLETUNER_LYCORIS),
    ("diffusers", "mochi", "transformer.transformer_blocks.0.attn1.to_k", PEFT,
     "diffusion_model.blocks.0.attn.qkv_x.weight", (0, 3072, 3072), SIMPLETUNER_PEFT),
    ("diffusers", "mochi", "transformer.transformer_blocks.1.attn1.add_v_proj", PEFT,
     "diffusion_model.blocks.1.attn.qkv_y.weight", (0, 2 * 3072, 3072), SIMPLETUNER_PEFT),  # y attends with x heads
    # SimpleTuner (bghira/SimpleTuner at bc8e6ab7) trains HunyuanVideo 1.5 only (HunyuanVideo15Transformer3DModel,
    # targets to_q/k/v, to_out.0 and add_q/k/v_proj, to_add_out); diffusers' 1.5 blocks keep 1.0's
    # names, so HunyuanVideo's converter rules place them (checked against diffusers' repository script by hand)
    ("SimpleTuner", "hunyuan_video15", "transformer.transformer_blocks.0.attn.add_k_proj", PEFT,
     "diffusion_model.double_blocks.0.txt_attn.qkv.weight", (0, 2048, 2048), SIMPLETUNER_PEFT),
    ("SimpleTuner", "hunyuan_video15", "transformer.transformer_blocks.0.ff.net.2", PEFT,
     "diffusion_model.double_blocks.0.img_mlp.2.weight", None, SIMPLETUNER_PEFT),
    ("diffusers", "cosmos", "transformer.transformer_blocks.0.attn1.to_q", PEFT,
     "diffusion_model.blocks.0.self_attn.q_proj.weight", None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "cosmos", "lycoris_transformer_blocks_0_ff_net_0_proj", LORA,
     "diffusion_model.blocks.0.mlp.layer1.weight", None, SIMPLETUNER_LYCORIS),
    ("SimpleTuner", "flux2", "transformer.double_stream_modulation_img.linear", PEFT,
     "diffusion_model.double_stream_modulation_img.lin.weight", None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "flux2", "transformer.time_guidance_embed.timestep_embedder.linear_1", PEFT,
     "diffusion_model.time_in.in_layer.weight", None, SIMPLETUNER_PEFT),
    ("SimpleTuner", "chroma", "lycoris_distilled_guidance_layer_layers_0_linear_1", LORA,
     "diffusion_model.distilled_guidance_layer.layers.0.in_layer.weight", None, SIMPLETUNER_LYCORIS),
    ("ai-toolkit", "sd15", "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SD15_TO_Q,
     None, AI_TOOLKIT),
    ("ai-toolkit", "sd15", "lora_te_text_model_encoder_layers_0_self_attn_q_proj", LORA, SD15_TE_Q, None, AI_TOOLKIT),
    ("ai-toolkit", "sdxl", "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", LORA, SDXL_TO_Q,
     None, AI_TOOLKIT),
    ("ai-toolkit", "sdxl_clip", "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", LORA, SDXL_TE1_Q, None,
     AI_TOOLKIT),
    ("ai-toolkit", "sdxl_clip", "lora_te2_text_model_encoder_layers_0_self_attn_q_proj", LORA, SDXL_TE2_Q, None,
     AI_TOOLKIT),
    ("ai-toolkit", "flux", "transformer.transformer_blocks.0.attn.to_q", PEFT, FLUX_QKV, FLUX_Q_ROWS, AI_TOOLKIT),
    ("ai-toolkit", "flux", "transformer.transformer_blocks.0.ff.net.2", PEFT,
     "diffusion_model.double_blocks.0.img_mlp.2.weight", None, AI_TOOLKIT),
    ("ai-toolkit", "flux", "transformer.single_transformer_blocks.0.proj_mlp", PEFT, FLUX_LINEAR1, FLUX_MLP_ROWS,
     AI_TOOLKIT),
    ("ai-toolkit", "flux", "transformer.single_transformer_blocks.1.proj_out", PEFT,
     "diffusion_model.single_blocks.1.linear2.weight", None, AI_TOOLKIT),
    ("OneTrainer OMI", "sd15", "unet.input_blocks.1.1.transformer_blocks.0.attn1.to_q", LORA, SD15_TO_Q, None, OT_OMI),
    ("OneTrainer OMI", "sd15", "unet.time_embed.0", LORA, "diffusion_model.time_embed.0.weight", None, OT_OMI),
    ("OneTrainer OMI", "sd15", "unet.output_blocks.1.1.transformer_blocks.0.ff.net.2", LORA,
     "diffusion_model.output_blocks.1.1.transformer_blocks.0.ff.net.2.weight", None, OT_OMI),
    ("OneTrainer OMI", "sd15", "clip_l.text_model.encoder.layers.0.self_attn.q_proj", LORA, SD15_TE_Q, None, OT_OMI),
    ("OneTrainer OMI", "sdxl", "unet.input_blocks.4.1.transformer_blocks.0.attn1.to_q", LORA, SDXL_TO_Q, None, OT_OMI),
    ("OneTrainer OMI", "sdxl", "unet.label_emb.0.0", LORA, "diffusion_model.label_emb.0.0.weight", None, OT_OMI),
    ("OneTrainer OMI", "sdxl", "unet.middle_block.1.transformer_blocks.0.ff.net.2", LORA,
     "diffusion_model.middle_block.1.transformer_blocks.0.ff.net.2.weight", None, OT_OMI),
    ("OneTrainer OMI", "sdxl_clip", "clip_l.text_model.encoder.layers.0.self_attn.q_proj", LORA, SDXL_TE1_Q, None,
     OT_OMI),
    ("OneTrainer OMI", "sdxl_clip", "clip_g.text_model.encoder.layers.0.self_attn.q_proj", LORA, SDXL_TE2_Q, None,
     OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.double_blocks.0.img_attn.proj", LORA,
     "diffusion_model.double_blocks.0.img_attn.proj.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.double_blocks.1.txt_mod.lin", LORA,
     "diffusion_model.double_blocks.1.txt_mod.lin.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.single_blocks.0.linear2", LORA,
     "diffusion_model.single_blocks.0.linear2.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.final_layer.adaLN_modulation.1", LORA,  # chunks swapped back to BFL order
     "diffusion_model.final_layer.adaLN_modulation.1.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.txt_in", LORA, "diffusion_model.txt_in.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.double_blocks.0.img_attn.qkv.0", LORA, FLUX_QKV, FLUX_Q_ROWS, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.single_blocks.0.linear1.3", LORA, FLUX_LINEAR1, FLUX_MLP_ROWS, OT_OMI),
    ("OneTrainer OMI", "flux", "transformer.img_in.proj", LORA, "diffusion_model.img_in.weight", None, OT_OMI),
    ("OneTrainer OMI", "flux_clip", "clip_l.text_model.encoder.layers.0.self_attn.q_proj", LORA, SDXL_TE1_Q, None,
     OT_OMI),
    ("OneTrainer OMI", "flux_clip", "clip_l.text_projection", LORA, "clip_l.transformer.text_projection.weight", None,
     OT_OMI),  # convert_clip.py map_clip: "text_projection"
    ("OneTrainer OMI", "flux_clip", "t5.encoder.block.0.layer.0.SelfAttention.q", LORA, FLUX_T5_Q, None, OT_OMI),
]
EXPECTED_MISSES = {  # (architecture, module name) -> why it does not map
    ("flux", "transformer.img_in.proj"): OMI_IMG_IN,
}
# OMI names one part of a fused weight `<fused>.<i>` (Flux's qkv in thirds, linear1 as q, k, v, MLP). ComfyUI's own
# flux_to_diffusers gives the rows of each part (its diffusers entries to_q, to_k, to_v, proj_mlp), but our key map
# (nodes/glue/keymap.py) does not yet list those parts by index; until it does, these modules are reported unmatched.


def _params() -> list:
    params = []
    for entry in NAMES:
        trainer, arch, name = entry[:3]
        reason = EXPECTED_MISSES.get((arch, name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        if arch == "ltx2" and not hasattr(supported, "LTXAV"):
            marks.append(pytest.mark.skip(reason="this ComfyUI has no LTX-2 (LTXAV)"))
        params.append(pytest.param(*entry, id=f"{trainer}-{arch}-{name}", marks=marks))
    return params


@pytest.fixture(scope="module")
def meta_models():
    """ComfyUI's own model classes, on the meta device: the key map and shapes a real checkpoint would give."""
    configs = {"sdxl": (supported.SDXL, SDXL_CONFIG), "flux": (supported.Flux, FLUX_CONFIG),
               "wan": (supported.WAN21_T2V, WAN_CONFIG), "wan_i2v": (supported.WAN21_I2V, WAN_I2V_CONFIG),
               "hunyuan_video": (supported.HunyuanVideo, HV_CONFIG), "ltxv": (supported.LTXV, LTXV_CONFIG),
               "hunyuan_video15": (supported.HunyuanVideo15, HV15_CONFIG),
               "zimage": (supported.ZImage, ZIMAGE_CONFIG), "mochi": (supported.GenmoMochi, MOCHI_CONFIG)}
    if hasattr(supported, "LTXAV"):  # 0.3.75 has no LTX-2
        configs["ltx2"] = (supported.LTXAV, LTX2_CONFIG)
    models = {arch: cls(dict(config)).get_model({}, "", device="meta") for arch, (cls, config) in configs.items()}
    traced = {arch.name: arch for arch in derive.ARCHS}  # built as the script builds them (fields per ComfyUI)
    for arch, name, config in (("flux2", "flux2", FLUX2_CONFIG), ("chroma", "chroma", CHROMA_CONFIG),
                               ("cosmos", "cosmos-predict2", COSMOS_CONFIG)):
        models[arch] = derive.meta_model(traced[name], config)
    models["sdxl_clip"] = comfy.sdxl_clip.SDXLClipModel(device="meta", dtype=torch.float16)
    models["flux_clip"] = comfy.text_encoders.flux.FluxClipModel(device="meta", dtype=torch.float16)
    return models


def _module(name: str, suffixes: tuple[str, str], out: int, inner: tuple[int, ...], rank: int = 2):
    down, up = suffixes
    sd = {f"{name}.{down}": torch.randn(rank, *inner) * 0.1, f"{name}.{up}": torch.randn(out, rank) * 0.1}
    if suffixes == LORA or down.startswith("lora_down"):
        sd[f"{name}.alpha"] = torch.tensor(float(rank))
    return sd


def _report(arch, name, suffixes, target, rows, sd15, meta_models):
    """Our coverage report for a one-module file with this name, shaped for `target` (rows of it)."""
    if arch == "sd15":
        model, clip = sd15
        shapes = {**model_shapes(model.model), **model_shapes(clip.cond_stage_model)}
    else:
        shapes = model_shapes(meta_models[arch])
    shape = shapes[target]
    out = rows[2] if rows else shape[0]
    lfile = parse_state_dict(_module(name, suffixes, out, tuple(shape[1:])), f"{arch}.safetensors")
    if arch == "sd15":
        return map_file(lfile, sd15[0], sd15[1], reference=False)[1]
    model = meta_models[arch]
    side = "clip" if arch.endswith("_clip") else "model"
    return build_patches(lfile, lora_key_map(model, is_clip=side == "clip"), {side: model_shapes(model)}, False)[1]


@pytest.mark.parametrize("trainer,arch,name,suffixes,target,rows,source", _params())
def test_trainer_names_reach_their_weight(trainer, arch, name, suffixes, target, rows, source, sd15, meta_models):
    report = _report(arch, name, suffixes, target, rows, sd15, meta_models)
    assert report.problems == [], f"{trainer} ({source}): {report.problems}"
    module_key = next(iter(report.applied))
    assert report.applied == {module_key: target}
    assert report.targets[module_key].target.offset == Offset.from_comfy(rows)


@pytest.mark.parametrize("arch,name", [key for key, reason in EXPECTED_MISSES.items() if reason])
def test_names_that_do_not_map_are_reported_with_the_reason(arch, name, sd15, meta_models):
    """The coverage report names each module that goes nowhere, with why (never a silent skip)."""
    entry = next(e for e in NAMES if e[1] == arch and e[2] == name)
    report = _report(arch, name, entry[3], entry[4], entry[5], sd15, meta_models)
    assert report.applied == {}
    read_as = split_key(f"{name}.{entry[3][0]}")[0]  # the module as the report names it (OMI: read as ComfyUI's)
    assert [(key.rsplit(".", 1)[0], reason.split(";")[0]) for key, reason in report.problems] == \
        [(read_as, "no weight of this model has this name")]
