"""The inspector names the trainer and the format of a file: `summarize(...).made_by`, its text line and JSON.

Files from tools installed here are written by those tools (lycoris-lora's own save_weights, PEFT's save_pretrained,
diffusers' save_lora_weights); for trainers that are not installable (OneTrainer, ai-toolkit, musubi-tuner,
sd-scripts) the metadata is what their savers write, as read in their source (cited at each fixture).
"""

import copy
import json

import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core.summary import summarize
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

loras = test_nodes.loras  # fixture: an empty loras folder ComfyUI lists


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(16, 16)
        self.to_k = nn.Linear(16, 16)

    def forward(self, x):
        return self.to_k(self.to_q(x))


def _lora(prefix: str, suffixes=("lora_down.weight", "lora_up.weight"), rank=4) -> dict[str, torch.Tensor]:
    down, up = suffixes
    return {f"{prefix}.{down}": torch.randn(rank, 16) * 0.1, f"{prefix}.{up}": torch.randn(16, rank) * 0.1}


def _write(tmp_path, name, sd, metadata=None):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def _made_by(path):
    summary = summarize(path)
    data = summary.to_json()["made_by"]
    assert data["line"] in summary.text()  # the Info node's text shows it
    assert json.loads(json.dumps(data)) == data  # and the panel's JSON carries it
    return data


# --- files written by the real tools ---------------------------------------------------------------------------------

def _lycoris_file(tmp_path, metadata):
    from lycoris import create_lycoris

    net = create_lycoris(Block(), 1.0, linear_dim=4, linear_alpha=2.0, algo="lokr")
    net.apply_to()
    path = tmp_path / "lycoris.safetensors"
    net.save_weights(str(path), torch.float32, metadata)
    return path


def test_lycoris_wrapper_file_without_metadata_names_its_format_not_a_trainer(tmp_path):
    made = _made_by(_lycoris_file(tmp_path, None))
    assert made["trainer"] is None
    assert made["format"].startswith("LyCORIS wrapper names")
    assert made["line"] == "made by: unknown trainer; LyCORIS wrapper names (lycoris_…) (no trainer metadata)"


def test_lycoris_file_with_lycoris_config_is_simpletuner(tmp_path):
    # bghira/SimpleTuner helpers/training/save_hooks.py _save_lycoris: save_weights(…, {"lycoris_config": json})
    made = _made_by(_lycoris_file(tmp_path, {"lycoris_config": json.dumps({"algo": "lokr", "linear_dim": 4})}))
    assert made["trainer"] == "SimpleTuner"
    assert made["format"].startswith("LyCORIS wrapper names")


def test_peft_save_pretrained(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"]))
    model.save_pretrained(str(tmp_path / "peft"))
    made = _made_by(tmp_path / "peft" / "adapter_model.safetensors")
    assert made["trainer"] is None
    assert made["format"] == "PEFT save_pretrained names (base_model.model.…)"


@pytest.mark.parametrize("with_config", [True, False])
def test_diffusers_save_lora_weights(tmp_path, with_config):
    from diffusers import StableDiffusionPipeline

    layers = _lora("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", ("lora_A.weight", "lora_B.weight"))
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["to_q"]} if with_config else None
    StableDiffusionPipeline.save_lora_weights(str(tmp_path), unet_lora_layers=layers, unet_lora_adapter_metadata=config)
    made = _made_by(tmp_path / "pytorch_lora_weights.safetensors")
    assert made["trainer"] is None
    expected = "diffusers/PEFT names (lora_A/lora_B)"
    assert made["format"] == (expected + ", diffusers save_lora_weights with its PEFT config" if with_config
                              else expected)


# --- metadata as each trainer's saver writes it ------------------------------------------------------------------

KOHYA_SD15 = _lora("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q")
KOHYA_ALPHA = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha"
CASES = {
    # Nerogar/OneTrainer modules/modelSaver/BaseModelSaver.py _create_safetensors_header: modelspec + ot_branch,
    # ot_revision (+ ot_config) + ss_base_model_version for SDXL: ss_ keys, yet not sd-scripts
    "onetrainer": (KOHYA_SD15, {"modelspec.sai_model_spec": "1.0.0", "modelspec.architecture":
                                "stable-diffusion-xl-v1-base/lora", "ot_branch": "master",
                                "ot_revision": "0123abc", "ss_base_model_version": "sdxl_"},
                   "OneTrainer", "kohya names (lora_unet_… / lora_te…)"),
    # ostris/ai-toolkit toolkit/metadata.py get_meta_for_safetensors: software (JSON of info.py) and format = pt
    "ai-toolkit": (_lora("diffusion_model.double_blocks.0.img_attn.qkv", ("lora_A.weight", "lora_B.weight")),
                   {"software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit",
                                            "version": "0.1.0"}), "format": "pt", "name": "my_flux_lora"},
                   "ai-toolkit", "diffusers/PEFT names (lora_A/lora_B)"),
    # kohya-ss/musubi-tuner utils/sai_model_spec.py build_metadata (modelspec.implementation of Wan) + ss_ keys
    "musubi-tuner": (_lora("lora_unet_blocks_0_self_attn_q"),
                     {"ss_network_module": "networks.lora_wan", "ss_network_dim": "4",
                      "modelspec.architecture": "wan2.1/lora",
                      "modelspec.implementation": "https://github.com/Wan-Video/Wan2.1"},
                     "musubi-tuner", "kohya names (lora_unet_… / lora_te…)"),
    # kohya-ss/sd-scripts train_network.py: ss_* training metadata
    "sd-scripts": (KOHYA_SD15, {"ss_network_module": "networks.lora", "ss_network_dim": "4"},
                   "kohya sd-scripts", "kohya names (lora_unet_… / lora_te…)"),
    "sd-scripts-lycoris": (KOHYA_SD15, {"ss_network_module": "lycoris.kohya", "ss_network_args": '{"algo": "lora"}'},
                           "kohya sd-scripts", "LyCORIS through sd-scripts (kohya names)"),
    # kohya-ss/sd-scripts networks/oft.py: oft_unet_<module>.oft_blocks / .alpha, ss_network_module = networks.oft
    "sd-scripts-oft": ({"oft_unet_down_blocks_0_attentions_0_proj_in.oft_blocks": torch.zeros(4, 4, 4),
                        "oft_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(1e-3)},
                       {"ss_network_module": "networks.oft"},
                       "kohya sd-scripts", "kohya sd-scripts OFT names (oft_unet_…)"),
    # bghira/SimpleTuner scripts' LyCORIS extract: format = simpletuner-lycoris-extract, lycoris_config
    "simpletuner-extract": (_lora("lycoris_transformer_blocks_0_attn_to_q"),
                            {"format": "simpletuner-lycoris-extract", "lycoris_config": "{}"},
                            "SimpleTuner", "LyCORIS wrapper names (lycoris_…)"),
    # OneTrainer with enable_omi_format (LoRASaverMixin.__save_safetensors -> convert_to_omi): the same header, keys
    # under the OMI component prefixes with the original model's paths (convert_sd_lora.py "unet", "1.1")
    "onetrainer-omi": ({**_lora("unet.input_blocks.1.1.transformer_blocks.0.attn1.to_q"),
                        **_lora("clip_l.text_model.encoder.layers.0.self_attn.q_proj")},
                       {"modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "stable-diffusion-v1/lora",
                        "ot_branch": "master", "ot_revision": "0123abc"},
                       "OneTrainer", "OneTrainer OMI names (unet./transformer./clip_l./t5. + the original model's paths)"),
    "omi-flux-no-metadata": (_lora("transformer.double_blocks.0.img_attn.proj"), None, None,
                             "OneTrainer OMI names (unet./transformer./clip_l./t5. + the original model's paths)"),
    # ai-toolkit's Flux LoRA (peft_format forced): diffusers names, lora_A/lora_B, no alpha
    "ai-toolkit-flux": (_lora("transformer.transformer_blocks.0.attn.to_q", ("lora_A.weight", "lora_B.weight")),
                        {"software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit",
                                                 "version": "0.1.0"}), "format": "pt"},
                        "ai-toolkit", "diffusers/PEFT names (lora_A/lora_B)"),
    "no-metadata": (KOHYA_SD15, None, None, "kohya names (lora_unet_… / lora_te…)"),
}


@pytest.mark.parametrize("case", CASES)
def test_trainer_from_metadata(tmp_path, case):
    sd, metadata, trainer, style = CASES[case]
    made = _made_by(_write(tmp_path, f"{case}.safetensors", sd, metadata))
    assert (made["trainer"], made["format"]) == (trainer, style)
    assert made["line"].startswith(f"made by: {trainer or 'unknown trainer'}; {style} (")


def test_software_field_of_another_tool_is_not_ai_toolkit(tmp_path):
    made = _made_by(_write(tmp_path, "x.safetensors", KOHYA_SD15, {"software": json.dumps({"name": "other"})}))
    assert made["trainer"] is None


# --- the video and newest models' trainers (issue #22) ------------------------------------------------------------

def _kohya(*prefixes: str) -> dict[str, torch.Tensor]:
    """kohya-style modules as musubi-tuner's LoRANetwork saves them: lora_down, lora_up and a scalar alpha."""
    return {k: v for p in prefixes for k, v in {**_lora(p), f"{p}.alpha": torch.tensor(4.0)}.items()}


def _musubi_metadata(network_module: str, base_model_version: str, architecture: str, implementation: str) -> dict:
    """What musubi-tuner writes (kohya-ss/musubi-tuner at 30c658c4): training/trainer_base.py save_model's ss_* keys
    (ss_base_model_version = the trainer's architecture_full_name, dataset/architectures.py) updated with
    utils/sai_model_spec.py build_metadata (architecture + "/lora", the implementation of that architecture)."""
    return {"ss_network_module": network_module, "ss_network_dim": "4", "ss_network_alpha": "4",
            "ss_base_model_version": base_model_version, "ss_steps": "100", "ss_epoch": "1",
            "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": architecture + "/lora",
            "modelspec.implementation": implementation, "modelspec.title": "my_lora",
            "modelspec.resolution": "1280x720", "modelspec.date": "2026-06-24T08:19:42"}


# One file per architecture musubi-tuner trains: module names by its rule (src/musubi_tuner/networks/lora.py
# create_modules: "lora_unet" + the module's path in musubi's own model, dots to "_"; the model and default targets
# of each networks/lora_<arch>.py are named at each entry), metadata by _musubi_metadata with the values of
# sai_model_spec.py build_metadata for that architecture. (case: (modules, network module, ss_base_model_version,
# modelspec architecture, modelspec implementation)). Those marked "new" were named kohya sd-scripts before; the
# others were musubi-tuner already, on the implementation alone (the evidence now names the architecture too).
MUSUBI_CASES = {
    # lora_wan.py, wan/modules/model.py (Wan's own names; I2V adds cross_attn.k_img): Wan 2.1 and 2.2 alike
    "wan2.1-i2v": (("lora_unet_blocks_0_self_attn_q", "lora_unet_blocks_0_cross_attn_k_img"),
                   "networks.lora_wan", "wan", "wan2.1", "https://github.com/Wan-Video/Wan2.1"),
    "wan2.2": (("lora_unet_blocks_39_ffn_0",), "networks.lora_wan", "wan", "wan2.1",
               "https://github.com/Wan-Video/Wan2.1"),
    # lora.py HUNYUAN_TARGET_REPLACE_MODULES, hunyuan_model/models.py (Tencent's names)
    "hunyuan-video": (("lora_unet_double_blocks_0_img_mlp_fc1", "lora_unet_single_blocks_0_linear2"), "networks.lora",
                      "hunyuan_video", "hunyuan-video", "https://github.com/Tencent/HunyuanVideo"),
    # new: lora_hv_1_5.py (MMDoubleStreamBlock), hunyuan_video_1_5/hunyuan_video_1_5_modules.py (split q/k/v)
    "hunyuan-video-1.5": (("lora_unet_double_blocks_0_img_attn_q", "lora_unet_double_blocks_0_img_mod_linear"),
                          "networks.lora_hv_1_5", "hunyuan_video_1_5", "hunyuan-video-1.5",
                          "https://github.com/Tencent-Hunyuan/HunyuanVideo-1.5"),
    # lora_framepack.py, frame_pack/hunyuan_video_packed.py (diffusers-like HunyuanVideoTransformerBlock)
    "framepack": (("lora_unet_transformer_blocks_0_attn_to_q", "lora_unet_single_transformer_blocks_0_attn_to_k"),
                  "networks.lora_framepack", "framepack", "framepack", "https://github.com/lllyasviel/FramePack"),
    # new: lora_flux.py, flux/flux_models.py (BFL's names); sd-scripts writes this implementation too (below)
    "flux.1-kontext": (("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"),
                       "networks.lora_flux", "flux_kontext", "Flux.1-dev", "https://github.com/black-forest-labs/flux"),
    # new: the same with --metadata_arch (build_metadata's custom_arch replaces the architecture)
    "flux.1-kontext-metadata-arch": (("lora_unet_double_blocks_0_img_attn_qkv",), "networks.lora_flux",
                                     "flux_kontext", "my-kontext", "https://github.com/black-forest-labs/flux"),
    # new: lora_flux_2.py, flux_2/flux2_models.py (BFL's names; flux2_utils.py FLUX2_MODEL_INFO for the versions)
    "flux.2-dev": (("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear2"),
                   "networks.lora_flux_2", "flux_2_dev", "Flux.2-dev", "https://github.com/black-forest-labs/flux2"),
    "flux.2-klein-4b": (("lora_unet_double_blocks_0_txt_mlp_2",), "networks.lora_flux_2", "flux_2_klein_4b",
                        "Flux.2-klein-4b", "https://github.com/black-forest-labs/flux2"),
    "flux.2-klein-9b": (("lora_unet_single_blocks_0_linear1",), "networks.lora_flux_2", "flux_2_klein_9b",
                        "Flux.2-klein-9b", "https://github.com/black-forest-labs/flux2"),
    # lora_qwen_image.py, qwen_image/qwen_image_model.py (diffusers' names); qwen_image_train_network.py sets the
    # Edit-Plus / Edit-2511 custom architectures from --model_version
    "qwen-image": (("lora_unet_transformer_blocks_0_attn_to_q", "lora_unet_transformer_blocks_0_img_mlp_net_0_proj"),
                   "networks.lora_qwen_image", "qwen_image", "Qwen-Image", "https://github.com/QwenLM/Qwen-Image"),
    "qwen-image-edit": (("lora_unet_transformer_blocks_0_attn_add_k_proj",), "networks.lora_qwen_image",
                        "qwen_image_edit", "Qwen-Image-Edit", "https://github.com/QwenLM/Qwen-Image"),
    "qwen-image-edit-2509": (("lora_unet_transformer_blocks_0_attn_to_out_0",), "networks.lora_qwen_image",
                             "qwen_image_edit", "Qwen-Image-Edit-Plus", "https://github.com/QwenLM/Qwen-Image"),
    "qwen-image-edit-2511": (("lora_unet_transformer_blocks_0_attn_to_add_out",), "networks.lora_qwen_image",
                             "qwen_image_edit", "Qwen-Image-Edit-2511", "https://github.com/QwenLM/Qwen-Image"),
    # new: the layered model has a repository of its own
    "qwen-image-layered": (("lora_unet_transformer_blocks_0_attn_to_v",), "networks.lora_qwen_image",
                           "qwen_image_layered", "Qwen-Image-Layered", "https://github.com/QwenLM/Qwen-Image-Layered"),
    # new: lora_zimage.py, zimage/zimage_model.py (split to_q/to_k/to_v, feed_forward.w1/w2/w3)
    "z-image": (("lora_unet_layers_0_attention_to_q", "lora_unet_layers_29_feed_forward_w2"), "networks.lora_zimage",
                "z_image", "Z-Image", "https://github.com/Tongyi-MAI/Z-Image"),
    # new: lora_kandinsky.py (default include patterns), kandinsky5/models/dit.py and nn.py
    "kandinsky-5": (("lora_unet_visual_transformer_blocks_0_self_attention_to_query",
                     "lora_unet_text_transformer_blocks_0_feed_forward_in_layer"), "networks.lora_kandinsky",
                    "kandinsky5", "Kandinsky-5", "https://github.com/kandinskylab/kandinsky-5"),
    # new: lora_hidream_o1.py (Qwen3VLTextDecoderLayer), hidream_o1/qwen3_vl_transformers.py
    # (Qwen3VLForConditionalGeneration.model.language_model.layers)
    "hidream-o1": (("lora_unet_model_language_model_layers_0_self_attn_q_proj",
                    "lora_unet_model_language_model_layers_0_mlp_gate_proj"), "networks.lora_hidream_o1",
                   "hidream_o1_image", "HiDream-O1-Image", "https://github.com/HiDream-ai/HiDream-O1-Image"),
    # new: lora_ideogram4.py (Ideogram4TransformerBlock), ideogram4/ideogram4_model.py
    "ideogram-4": (("lora_unet_layers_0_attention_qkv", "lora_unet_layers_0_feed_forward_w1"),
                   "networks.lora_ideogram4", "ideogram4", "Ideogram-4", "https://huggingface.co/Comfy-Org/Ideogram-4"),
    # new: lora_krea2.py (every Linear), krea2/krea2_mmdit.py (SingleStreamDiT.blocks: attn.wq, mlp.gate)
    "krea-2": (("lora_unet_blocks_0_attn_wq", "lora_unet_blocks_0_mlp_gate"), "networks.lora_krea2", "krea2",
               "Krea-2", "https://github.com/krea-ai/krea-2"),
}


@pytest.mark.parametrize("case", MUSUBI_CASES)
def test_musubi_tuner_for_every_architecture_it_trains(tmp_path, case):
    prefixes, network_module, base_version, architecture, implementation = MUSUBI_CASES[case]
    metadata = _musubi_metadata(network_module, base_version, architecture, implementation)
    made = _made_by(_write(tmp_path, f"{case}.safetensors", _kohya(*prefixes), metadata))
    assert (made["trainer"], made["format"]) == ("musubi-tuner", "kohya names (lora_unet_… / lora_te…)")
    told_by = (f"modelspec.architecture = {architecture}/lora" if case != "flux.1-kontext-metadata-arch"
               else f"ss_base_model_version = {base_version}")
    assert made["evidence"] == f"ss_ keys and modelspec.implementation = {implementation}, {told_by}"
    assert made["line"] == f"made by: musubi-tuner; kohya names (lora_unet_… / lora_te…) ({made['evidence']})"


def test_sd_scripts_flux_is_not_musubi_kontext(tmp_path):
    """sd-scripts writes musubi's Flux.1 Kontext implementation for its own Flux LoRAs (kohya-ss/sd-scripts at 48d368fa,
    library/sai_model_spec.py IMPL_FLUX, ARCH_FLUX_1_DEV; flux_train_network.py: ss_base_model_version flux1)."""
    metadata = {"ss_network_module": "networks.lora_flux", "ss_network_dim": "4", "ss_base_model_version": "flux1",
                "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "flux-1-dev/lora",
                "modelspec.implementation": "https://github.com/black-forest-labs/flux"}
    made = _made_by(_write(tmp_path, "sd-scripts-flux.safetensors",
                           _kohya("lora_unet_double_blocks_0_img_attn_qkv"), metadata))
    assert (made["trainer"], made["evidence"]) == ("kohya sd-scripts", "ss_network_module = networks.lora_flux")


def _peft_default(*prefixes: str) -> dict[str, torch.Tensor]:
    """PEFT's own parameter names with its adapter name, as a state dict of an injected model holds them."""
    return {k: v for p in prefixes for k, v in _lora(p, ("lora_A.default.weight", "lora_B.default.weight")).items()}


OT_META = {"modelspec.sai_model_spec": "1.0.0", "modelspec.implementation": "https://github.com/huggingface/diffusers",
           "ot_branch": "master", "ot_revision": "23df3832"}
DIFFSYNTH = "DiffSynth-Studio names (PEFT with its adapter name, no prefix)"
ORIGINAL = "original-model names (diffusion_model.…)"
OT_COMFY = "OneTrainer COMFY format (diffusion_model. + the original model's paths, alpha kept)"
DIFFSYNTH_META = {"format": "pt"}  # accelerate's save(safe_serialization=True), which DiffSynth's ModelLogger calls
# (case: (state dict, metadata, trainer, format, new)): `new` cases were named otherwise before (trainer or format);
# the others guard what must not change (a trainer the names alone cannot prove).
NAME_CASES = {
    # DiffSynth-Studio (modelscope/DiffSynth-Studio at fed7b18f): PEFT's inject_adapter_in_model on its own model
    # (diffsynth/diffusion/training_module.py add_lora_to_model), the trainable parameters minus "pipe.dit."
    # (export_trainable_state_dict; parsers.py --remove_prefix_in_ckpt), saved by accelerate (logger.py save_model).
    # Its models' paths: diffsynth/models/z_image_dit.py (layers + refiners, split to_q/to_k/to_v, to_out.0),
    # flux_dit.py (its own Flux names, without --align_to_opensource_format), qwen_image_dit.py (img_mod.1),
    # flux2_dit.py (diffusers' names), ltx2_dit.py (LTX-2's names); targets from examples/*/model_training/lora/*.sh
    "diffsynth-z-image": (_peft_default("layers.0.attention.to_q", "noise_refiner.0.attention.to_out.0",
                                        "layers.29.feed_forward.w2"), DIFFSYNTH_META, None, DIFFSYNTH, True),
    "diffsynth-flux": (_peft_default("blocks.0.attn.a_to_qkv", "blocks.18.ff_a.0", "single_blocks.0.to_qkv_mlp"),
                       DIFFSYNTH_META, None, DIFFSYNTH, True),
    "diffsynth-qwen-image": (_peft_default("transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mod.1"),
                             DIFFSYNTH_META, None, DIFFSYNTH, True),
    "diffsynth-flux.2": (_peft_default("transformer_blocks.0.attn.to_q",
                                       "single_transformer_blocks.0.attn.to_qkv_mlp_proj"),
                         DIFFSYNTH_META, None, DIFFSYNTH, True),
    "diffsynth-ltx-2": (_peft_default("transformer_blocks.0.attn1.to_q",
                                      "transformer_blocks.0.audio_to_video_attn.to_out.0"),
                        DIFFSYNTH_META, None, DIFFSYNTH, True),
    # OneTrainer (Nerogar/OneTrainer at 23df3832, modules/modelSaver/mixin/LoRASaverMixin.py): COMFY_LORA
    # (_save_comfy: the original paths of modules/model/<X>Model.py lora_diffusers_to_comfy under diffusion_model.,
    # lora_A/lora_B via convert_lora_suffix_ab(peft_convention=False), alpha kept; HunyuanVideo's preset's format)
    "onetrainer-comfy-hunyuan-video": (
        {**_kohya("diffusion_model.double_blocks.0.img_attn_qkv"), **_kohya("diffusion_model.single_blocks.0.linear1")},
        {**OT_META, "modelspec.architecture": "hunyuan-video/lora"}, "OneTrainer", OT_COMFY, True),
    "onetrainer-comfy-z-image": (
        {k.replace("lora_down", "lora_A").replace("lora_up", "lora_B"): v
         for k, v in _kohya("diffusion_model.layers.0.attention.to_q").items()},
        {**OT_META, "modelspec.architecture": "Z-Image/lora"}, "OneTrainer", OT_COMFY, True),
    # COMFY_LORA renames only LoRA modules: a LoHa keeps its hada_* names and alpha
    "onetrainer-comfy-loha": (
        {"diffusion_model.double_blocks.0.img_attn.qkv.hada_w1_a": torch.zeros(16, 2),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w1_b": torch.zeros(2, 16),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w2_a": torch.zeros(16, 2),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w2_b": torch.zeros(2, 16),
         "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(2.0)},
        {**OT_META, "modelspec.architecture": "Flux.2/lora"}, "OneTrainer", OT_COMFY, True),
    # LEGACY_LORA: convert_to_mixture for HunyuanVideo and Flux (modelSaver/hunyuanVideo/HunyuanVideoLoRASaver.py,
    # flux/FluxLoRASaver.py: transformer -> lora_transformer, the diffusers path underscored)
    "onetrainer-legacy-hunyuan-video": (
        _kohya("lora_transformer_transformer_blocks_0_attn_to_q",
               "lora_transformer_single_transformer_blocks_0_proj_mlp"),
        {**OT_META, "modelspec.architecture": "hunyuan-video/lora"}, "OneTrainer",
        "OneTrainer LEGACY format (lora_transformer_ + diffusers paths)", True),
    # ... and the canonical dict for Z-Image, Qwen-Image and Flux.2 (zImage/ZImageLoRASaver.py, qwen/QwenLoRASaver.py,
    # flux2/Flux2LoRASaver.py: `return dict(state_dict)`)
    "onetrainer-legacy-qwen-image": (
        _kohya("transformer.transformer_blocks.0.attn.add_k_proj", "transformer.transformer_blocks.0.img_mod.1"),
        {**OT_META, "modelspec.architecture": "Qwen-Image/lora"}, "OneTrainer",
        "OneTrainer LEGACY format (transformer. + diffusers paths, lora_down/lora_up + alpha)", True),
    # DIFFUSERS_LORA (the Flux, Flux.2, Qwen-Image and Z-Image presets' format): diffusers' names, alpha folded
    "onetrainer-diffusers-z-image": (
        _lora("transformer.layers.0.attention.to_q", ("lora_A.weight", "lora_B.weight")),
        {**OT_META, "modelspec.architecture": "Z-Image/lora"}, "OneTrainer", "diffusers/PEFT names (lora_A/lora_B)",
        False),
    # the COMFY names without OneTrainer's metadata name no trainer: SimpleTuner's lora_format=comfyui writes
    # diffusion_model. + alpha too, and so does ComfyUI's trainer, which also writes .diff/.diff_b
    "comfy-names-without-metadata": (
        {"diffusion_model.double_blocks.0.img_attn.qkv.hada_w1_a": torch.zeros(16, 2),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w1_b": torch.zeros(2, 16),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w2_a": torch.zeros(16, 2),
         "diffusion_model.double_blocks.0.img_attn.qkv.hada_w2_b": torch.zeros(2, 16),
         "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(2.0)}, None, None, ORIGINAL, False),
    # ComfyUI's trainer (comfy_extras/nodes_train.py _create_weight_adapter/_create_bias_adapter: `<module>.<param>`
    # of BaseModel's modules, alpha 1.0, BiasDiff `.diff` on 1-D weights and `.diff_b` on biases; SaveLoRA, no
    # metadata) on Wan and on Z-Image with LoKr, ComfyUI's own module paths (comfy/ldm/wan/model.py, lumina/model.py)
    "comfyui-trainer-wan": (
        {**_kohya("diffusion_model.blocks.0.self_attn.q"),
         "diffusion_model.blocks.0.self_attn.q.diff_b": torch.zeros(16),
         "diffusion_model.blocks.0.norm3.diff": torch.zeros(16),
         "diffusion_model.blocks.0.norm3.diff_b": torch.zeros(16)},
        None, "ComfyUI trainer", ORIGINAL, True),
    "comfyui-trainer-z-image-lokr": (
        {"diffusion_model.layers.0.attention.qkv.lokr_w1": torch.zeros(2, 2),
         "diffusion_model.layers.0.attention.qkv.lokr_w2": torch.zeros(24, 8),
         "diffusion_model.layers.0.attention.qkv.alpha": torch.tensor(1.0),
         "diffusion_model.layers.0.attention_norm1.diff": torch.zeros(16)}, None, "ComfyUI trainer", ORIGINAL, True),
    # the same names with metadata are not SaveLoRA's
    "comfyui-names-with-metadata": (
        {**_kohya("diffusion_model.blocks.0.self_attn.q"), "diffusion_model.blocks.0.norm3.diff": torch.zeros(16)},
        {"modelspec.title": "x"}, None, ORIGINAL, False),
}


@pytest.mark.parametrize("case", NAME_CASES)
def test_trainer_and_format_from_key_names(tmp_path, case):
    sd, metadata, trainer, style, _new = NAME_CASES[case]
    made = _made_by(_write(tmp_path, f"{case}.safetensors", sd, metadata))
    assert (made["trainer"], made["format"]) == (trainer, style)
    evidence = made["evidence"]
    if trainer == "ComfyUI trainer":
        assert "no metadata" in evidence and ".diff/.diff_b" in evidence and "TrainLoraNode" in evidence
    assert made["line"] == f"made by: {trainer or 'unknown trainer'}; {style} ({evidence})"


def _diffsynth(relative: str):
    """A file of the installed DiffSynth-Studio (diffsynth 2.1.12, installed by scripts/setup.sh without its training
    dependencies, which its package's __init__ imports), parsed without importing the package."""
    import ast
    import importlib.util
    from pathlib import Path

    package = Path(importlib.util.find_spec("diffsynth").submodule_search_locations[0])
    return ast.parse((package / relative).read_text(encoding="utf-8"))


def _diffsynth_class(relative: str, name: str, methods: tuple[str, ...] | None = None) -> type:
    """DiffSynth's class `name` from `relative`, or only its `methods` on an nn.Module (the rest of that file imports
    what is not installed)."""
    import ast

    tree = _diffsynth(relative)
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    if methods is not None:
        cls.body = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in methods]
        cls.bases = [ast.parse("nn.Module", mode="eval").body]
        cls.decorator_list = []
    namespace = {"nn": nn, "torch": torch, "os": __import__("os")}
    if name == "ModelLogger":
        from accelerate import Accelerator

        namespace["Accelerator"] = Accelerator
    exec(compile(ast.Module(body=[cls], type_ignores=[]), relative, "exec"), namespace)  # noqa: S102
    return namespace[name]


def test_diffsynth_file_written_by_diffsynths_own_save_code(tmp_path):
    """A Wan LoRA written by DiffSynth-Studio's own save path (the installed diffsynth 2.1.12): its training
    module's parse_lora_target_modules and add_lora_to_model (PEFT's inject_adapter_in_model, LoraConfig(r,
    lora_alpha=r)) with its parser's default targets "q,k,v,o,ffn.0,ffn.2" on the model at `pipe.dit`, then
    ModelLogger.save_model with an accelerate Accelerator: export_trainable_state_dict minus --remove_prefix_in_ckpt's
    default "pipe.dit.", accelerate's safetensors save. The model has Wan's own module names, which DiffSynth's
    WanModel (diffsynth/models/wan_video_dit.py) and ComfyUI's share: blocks.N.self_attn/cross_attn.q/k/v/o,
    ffn.0/2."""
    from accelerate import Accelerator

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    class WanBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.cross_attn = Attention(), Attention()
            self.ffn = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))

    class Wan(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(WanBlock() for _ in range(2))
            self.head = nn.Linear(16, 16)

    training_module = _diffsynth_class("diffusion/training_module.py", "DiffusionTrainingModule",
                                       ("parse_lora_target_modules", "add_lora_to_model", "trainable_param_names",
                                        "export_trainable_state_dict"))
    model_logger = _diffsynth_class("diffusion/logger.py", "ModelLogger")
    training = training_module()
    training.pipe = nn.Module()
    training.pipe.dit = Wan().requires_grad_(False)
    targets = training.parse_lora_target_modules(training.pipe.dit, "q,k,v,o,ffn.0,ffn.2")  # its parser's default
    training.pipe.dit = training.add_lora_to_model(training.pipe.dit, targets, 4)
    model_logger(str(tmp_path), remove_prefix_in_ckpt="pipe.dit.").save_model(
        Accelerator(cpu=True), training, "epoch-0.safetensors")
    path = tmp_path / "epoch-0.safetensors"
    with safe_open(str(path), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert "blocks.0.self_attn.q.lora_A.default.weight" in keys and len(keys) == 2 * 2 * 10
    assert metadata == DIFFSYNTH_META
    made = _made_by(path)
    assert (made["trainer"], made["format"]) == (None, DIFFSYNTH)
    assert made["line"] == f"made by: unknown trainer; {DIFFSYNTH} (no trainer metadata)"
    assert summarize(path).module_count == 20  # and the loader reads every module


# ComfyUI's own trainer, run as nodes on the tiny SD1.5 ---------------------------------------------------------------

@pytest.fixture(scope="module")
def comfy_trained(tmp_path_factory):
    """The file SaveLoRA writes for one TrainLoraNode step with LoRA, its default algorithm (as
    test_comfy_trainer_oft.py runs it for OFT)."""
    from test_comfy_trainer_oft import train_and_save

    return train_and_save(tmp_path_factory.mktemp("comfy_output"), "LoRA", ".lora_up.weight", "comfy_lora")


def test_comfyui_trainer_file(comfy_trained):
    made = _made_by(comfy_trained)
    assert (made["trainer"], made["format"]) == ("ComfyUI trainer", ORIGINAL)
    assert made["line"] == f"made by: ComfyUI trainer; {ORIGINAL} ({made['evidence']})"
    assert "TrainLoraNode + SaveLoRA" in made["evidence"]


def test_comfyui_trainer_file_without_its_alphas_is_the_extractors(tmp_path, comfy_trained):
    """Without its alphas the trainer's file has the names ComfyUI's Extract and Save Lora writes
    (comfy_extras/nodes_lora_extract.py calc_lora_model: lora_up/lora_down, .diff on 1-D weights and .diff_b on
    biases with bias_diff, no alpha, no metadata): only the format is named then."""
    from safetensors.torch import load_file

    sd = {k: v for k, v in load_file(str(comfy_trained)).items() if not k.endswith(".alpha")}
    assert any(k.endswith(".diff") for k in sd) and any(k.endswith(".diff_b") for k in sd)
    made = _made_by(_write(tmp_path, "extracted.safetensors", sd))
    assert (made["trainer"], made["format"], made["evidence"]) == (None, ORIGINAL, "no trainer metadata")

# --- the alpha the loader uses, for PEFT/diffusers files ---------------------------------------------------------------
# PEFT state dicts carry no alpha: the loader takes it from diffusers' lora_adapter_metadata, else from the
# adapter_config.json PEFT's save_pretrained writes beside the file, else assumes alpha = rank with a warning. The
# summary must show the same. Truth: PEFT's own per-layer r, lora_alpha and scaling of the adapted layers.

PATTERNS = {"r": 4, "lora_alpha": 6, "rank_pattern": {"c3": 2, "^lin": 3}, "alpha_pattern": {"c.*n": 13, "c1": 1}}
RSLORA = {"r": 4, "lora_alpha": 7, "use_rslora": True}


def _peft_truth(model) -> dict[str, tuple[int, float, float]]:
    """layer name -> (r, lora_alpha, scaling) as PEFT itself holds them."""
    from test_peft_scale import LAYERS

    return {name: (layer.r["default"], layer.lora_alpha["default"], layer.scaling["default"])
            for name in LAYERS if hasattr(layer := getattr(model, name), "scaling")}


def _summary_modules(summary) -> dict[str, tuple[int, float, float]]:
    """layer name -> (rank, alpha, scale) as the summary shows them."""
    return {m.key.rsplit(".", 2)[-2]: (m.rank, m.alpha, m.scale) for m in summary.modules}


def _assert_summary_is_peft_s(summary, truth):
    got = _summary_modules(summary)
    assert sorted(got) == sorted(truth)
    for name, (r, alpha, scaling) in truth.items():
        assert got[name] == (r, pytest.approx(alpha), pytest.approx(scaling)), name


@pytest.mark.parametrize("options", [PATTERNS, RSLORA], ids=["patterns", "rslora"])
def test_summary_alpha_from_lora_adapter_metadata(tmp_path, options):
    from test_peft_scale import adapted, lora, save_diffusers

    config = lora(**options)
    model, _base = adapted(config)
    summary = summarize(save_diffusers(tmp_path, model, config))
    _assert_summary_is_peft_s(summary, _peft_truth(model))
    assert summary.alpha == {"min": min(a for _r, a, _s in _peft_truth(model).values()),
                             "max": max(a for _r, a, _s in _peft_truth(model).values())}
    assert summary.alpha_from["source"] == "lora_adapter_metadata"
    assert summary.warnings == []
    line = summary.alpha_from["line"]
    assert line in summary.text() and "lora_adapter_metadata" in line
    if options is RSLORA:
        assert summary.alpha_from["rslora"] and "rsLoRA" in line
    else:
        assert summary.alpha_from["patterns"] == ["rank_pattern", "alpha_pattern"] and "alpha_pattern" in line
    assert json.loads(json.dumps(summary.to_json()))["alpha_from"] == summary.alpha_from  # the panel's data


def test_summary_alpha_from_adapter_config_json(tmp_path):
    from peft import get_peft_model
    from test_peft_scale import Net, lora, save_pretrained

    config = lora(**PATTERNS)
    path, _base, _changes = save_pretrained(tmp_path, config)
    model = get_peft_model(Net(), copy.deepcopy(config)).base_model.model  # r, alpha and scaling need no weights
    summary = summarize(path)
    _assert_summary_is_peft_s(summary, _peft_truth(model))
    assert summary.alpha_from["source"] == str(tmp_path / "adapter_config.json")
    assert summary.warnings == []


def test_summary_without_any_alpha_warns_like_the_loader(tmp_path):
    from lycoris_nodes.lycoris_core import load
    from test_peft_scale import adapted, lora, save_diffusers

    model, _base = adapted(lora(**PATTERNS))
    path = save_diffusers(tmp_path, model)  # no config anywhere: diffusers loads it with alpha = rank
    summary = summarize(path)
    ranks = {name: r for name, (r, _a, _s) in _peft_truth(model).items()}
    assert _summary_modules(summary) == {name: (r, None, 1.0) for name, r in ranks.items()}
    assert summary.alpha is None and summary.alpha_from["source"] is None
    assert summary.warnings == load(path).warnings and len(summary.warnings) == 1
    assert "assumed alpha = rank" in summary.warnings[0] and summary.warnings[0] in summary.text()


def test_kohya_file_alpha_is_from_the_file(tmp_path):
    summary = summarize(_write(tmp_path, "k.safetensors", {**KOHYA_SD15, KOHYA_ALPHA: torch.tensor(2.0)}))
    assert [(m.rank, m.alpha, m.scale) for m in summary.modules] == [(4, 2.0, 0.5)]
    assert summary.alpha_from["source"] == "file" and summary.warnings == []


def test_info_node_shows_the_alpha_from_adapter_config_json(loras):
    """Through the LyCORIS Info node as ComfyUI runs it: PEFT's save_pretrained folder copied into the loras folder,
    the summary text and the panel's data carry the config's alpha."""
    from lycoris_nodes.nodes.inspection.info import LycorisInfo
    from test_coverage import panel, run
    from test_peft_scale import lora, save_pretrained

    save_pretrained(loras / "peft", lora(**PATTERNS))
    (text, _triggers, _coverage), ui = run(LycorisInfo, lycoris_name="peft/adapter_model.safetensors")
    data = panel(ui)["summary"]
    assert data["alpha"] == {"min": 1, "max": 13}  # alpha_pattern's c1 and c3n; the others take lora_alpha 6
    assert data["alpha_from"]["source"] == str(loras / "peft" / "adapter_config.json")
    assert data["alpha_from"]["line"] in text and data["warnings"] == []
