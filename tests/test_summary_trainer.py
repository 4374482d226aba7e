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
    from lycoris_nodes.nodes.info import LycorisInfo
    from test_coverage import panel, run
    from test_peft_scale import lora, save_pretrained

    save_pretrained(loras / "peft", lora(**PATTERNS))
    (text, _triggers, _coverage), ui = run(LycorisInfo, lycoris_name="peft/adapter_model.safetensors")
    data = panel(ui)["summary"]
    assert data["alpha"] == {"min": 1, "max": 13}  # alpha_pattern's c1 and c3n; the others take lora_alpha 6
    assert data["alpha_from"]["source"] == str(loras / "peft" / "adapter_config.json")
    assert data["alpha_from"]["line"] in text and data["warnings"] == []
