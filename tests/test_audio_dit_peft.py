"""ACE-Step 1.5 (audio) adapter files from the tools that write them, end to end, against each tool's own truth.

ACE-Step 1.5 exists in ComfyUI 0.33 only (skipped on 0.3.75). ComfyUI's model (`supported_models.ACEStep15`, tiny
widths, fp32, random weights, in a ModelPatcher) is the trainers' own model: ComfyUI's port keeps the original's
module paths (`decoder.layers.N.self_attn.q_proj`, `decoder.condition_embedder`, ...), and every trainer adapts the
decoder alone, so the twin the adapters are made on is ComfyUI's own decoder (a copy), with its names:

- the official trainer (ace-step/ACE-Step-1.5 acestep/training/lora_utils.py inject_lora_into_dit /
  save_lora_weights): PEFT's get_peft_model over `model.decoder` (LoRAConfig: r 8, alpha 16, q/k/v/o_proj;
  its later configs.py adds use_dora and the MLP), written by the decoder's `save_pretrained`:
  `base_model.model.<decoder path>` + adapter_config.json (alpha not baked). rsLoRA is PEFT's option of the same
  file (alpha / sqrt(r), read from adapter_config.json). Truth: PEFT's own merge() (float64).
- the official trainer's LoKr (acestep/training/lokr_utils.py inject_lokr_into_dit / save_lokr_weights, as in its
  forks riversedge/ACE-Step-1.5 and sdbds/ACE-Step-1.5-for-windows): lycoris-lora's create_lycoris over the decoder
  (LoKRConfig: linear_dim 64, linear_alpha 128, factor -1, q/k/v/o_proj, weight_decompose -> dora_wd) saved by
  LycorisNetwork.save_weights: `lycoris_` + the decoder path, dots as underscores. SimpleTuner's ACE-Step 1.5
  (bghira/SimpleTuner simpletuner/helpers/models/ace_step/model.py DEFAULT_V15_LORA_TARGET q/k/v/o_proj over the
  original's decoder; save_hooks.py _save_lycoris) writes the same names; Comfy-Org/ComfyUI#12638's file
  (`lycoris_layers_0_cross_attn_k_proj.lokr_w2_a`, `lycoris_condition_embedder.dora_scale`) is LoKr with split w2 and
  DoRA on every Linear. At these tiny widths linear_dim 2 splits w2 as 64 does at the released 2048 (rank below half
  of w2's larger side), keeping the official alpha / dim = 2. Truth: the network's forward (float64).

- diffusers 0.42.1's own ACE-Step 1.5 (`AceStepTransformer1DModel`, its `AceStepPipeline.save_lora_weights`, with
  the PEFT config as metadata): `transformer.` + diffusers' names (`layers.0.self_attn.to_q`, `to_out.0`). The twin
  is diffusers' model holding ComfyUI's weights under the names diffusers' own LoRA converter gives them
  (`_convert_non_diffusers_ace_step_lora_to_diffusers`: q/k/v/o_proj -> to_q/k/v/to_out.0; every other Linear keeps
  its path); every Linear lands in it (only the q/k norms and the patch convs are named otherwise). Truth: PEFT's
  merge() there, read back onto ComfyUI's weights through the same converter.

Each file goes through our loader node at strengths 1 and 0.5, merged and bypassed: every module of the file
applies (no problems, no unused keys), each adapted weight is within 1e-4 of its largest change of the truth (fp32;
bypassed: the layer's own output on the identity), and every other weight is untouched.
"""

import copy
import json
import re

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
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from reference.lycoris_factory import SEED
from test_nodes import run_node, weights_after_full_load
from test_peft_dit import adapted, assert_weights_match, merged_parameters, put
from test_trainer_names_image import CONFIGS
from test_video_dit_peft import Arch, comfy_model, lycoris_network

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not hasattr(comfy.supported_models, "ACEStep15"),
                                 reason="this ComfyUI has no supported_models.ACEStep15 (ComfyUI 0.33 has)")]
loras = test_nodes.loras

DECODER = "diffusion_model.decoder."
STRENGTHS = (1.0, 0.5)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the official trainer's and SimpleTuner's default targets
MLP = ("gate_proj", "up_proj", "down_proj")


def _official(**options):
    """acestep/training/configs.py LoRAConfig as inject_lora_into_dit hands it to PEFT."""
    return peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": list(ATTENTION), "bias": "none",
                              "task_type": peft.TaskType.FEATURE_EXTRACTION, "init_lora_weights": False, **options})


PEFT_CASES = {
    # ace-step/ACE-Step-1.5 acestep/training/configs.py LoRAConfig defaults (r 8, alpha 16, attention only)
    "official": _official(),
    # PEFT's rsLoRA option on the same file (alpha / sqrt(r)), read from adapter_config.json; alpha 128 as later
    # versions of the trainer's configs.py LoRAConfig default it (with use_dora and target_mlp)
    "official-rslora": _official(lora_alpha=128, use_rslora=True),
    # the later configs.py LoRAConfig: use_dora and target_mlp (gate/up/down_proj)
    "official-dora-mlp": _official(use_dora=True, target_modules=[*ATTENTION, *MLP]),
}
# create_lycoris options (lokr_utils.inject_lokr_into_dit) and the modules they wrap
LYCORIS_CASES = {
    "official-lokr": ({"linear_dim": 2, "linear_alpha": 4, "factor": -1}, ATTENTION),
    "official-lokr-dora": ({"linear_dim": 2, "linear_alpha": 4, "factor": -1, "dora_wd": True}, ATTENTION),
    "official-lokr-dora-both": ({"linear_dim": 2, "linear_alpha": 4, "factor": -1, "dora_wd": True,
                                 "decompose_both": True}, ATTENTION),
    # #12638's file: every Linear of the decoder (condition_embedder, time embedders, MLP too)
    "simpletuner-lokr-dora-all": ({"linear_dim": 2, "linear_alpha": 4, "factor": 4, "dora_wd": True}, None),
}


@pytest.fixture(scope="module")
def acestep():
    """ComfyUI's ACE-Step 1.5 (tiny, fp32, random weights) in a ModelPatcher."""
    model = comfy_model(Arch("ACEStep15", CONFIGS["acestep15"][1], "", "", {}, "", ()))
    yield comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    comfy.model_management.unload_all_models()


def decoder(patcher) -> torch.nn.Module:
    return patcher.model.diffusion_model.decoder


def linear_names(module: torch.nn.Module, suffixes=None) -> list[str]:
    """The Linear layers of the decoder (ending in one of `suffixes`, if given)."""
    return [name for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)
            and (suffixes is None or name.rsplit(".", 1)[-1] in suffixes)]


def peft_file(patcher, case: str, folder):
    """The official trainer's save: the decoder's save_pretrained (a folder: the weights and adapter_config.json)."""
    model = adapted(decoder(patcher), PEFT_CASES[case], "save_pretrained", seed=SEED + sum(map(ord, case)))
    model.save_pretrained(str(folder / case))
    written = {f"{case}/adapter_model.safetensors": None, f"{case}/adapter_config.json": None}
    return {name: (folder / name).read_bytes() for name in written}, merged_parameters(model)


@torch.no_grad()
def lycoris_file(patcher, case: str, folder):
    """create_lycoris over a float64 copy of the decoder, saved with save_weights; truth: each wrapped layer's output
    on the identity."""
    options, suffixes = LYCORIS_CASES[case]
    twin = copy.deepcopy(decoder(patcher)).double()
    names = linear_names(twin, suffixes)
    config = {"algo": "lokr", "multiplier": 1.0, **options,
              "apply_preset": {"target_module": [], "target_name": [rf"{re.escape(n)}$" for n in names]}}
    net = lycoris_network(twin, config, SEED + sum(map(ord, case)))
    assert sorted(lora.lora_name for lora in net.loras) == sorted("lycoris_" + n.replace(".", "_") for n in names)
    layers = {name: twin.get_submodule(name) for name in names}
    before = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    net.apply_to()
    path = folder / f"{case}.safetensors"
    # the metadata each saver writes: SimpleTuner's _save_lycoris its lycoris_config, lokr_utils.save_lokr_weights
    # algo/format and the LoKRConfig
    metadata = ({"lycoris_config": json.dumps(config)} if case.startswith("simpletuner")
                else {"algo": "lokr", "format": "lycoris", "lokr_config": json.dumps(options)})
    net.save_weights(str(path), torch.float32, metadata)
    merged = {f"{name}.weight": (before[name], effective_weight(layer)) for name, layer in layers.items()}
    return {path.name: path.read_bytes()}, merged


def effective_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """W' of a layer as it computes: its output on the identity is W'ᵀ + b."""
    eye = torch.eye(layer.in_features, dtype=layer.weight.dtype)
    bias = 0 if layer.bias is None else layer.bias
    return (layer(eye) - bias).T.contiguous()


@pytest.fixture(scope="module")
def files(acestep, tmp_path_factory):
    folder = tmp_path_factory.mktemp("acestep_files")
    made = {}

    def make(case):
        if case not in made:
            made[case] = (peft_file if case in PEFT_CASES else lycoris_file)(acestep, case, folder)
        return made[case]

    return make


def check_file(patcher, loras, written, merged) -> None:
    """Every module applies; merged and bypassed, at each strength, each adapted weight is the truth and every other
    weight is as it was."""
    base = {k: v.detach().clone() for k, v in patcher.model.state_dict().items() if k.startswith(DECODER)}
    truth = {DECODER + name: value for name, value in merged.items()}
    assert truth and set(truth) <= set(base)
    name = put(loras, written)
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == [], (report.problems, report.unused_keys)
    assert len(report.applied) == report.total == len(truth)
    for strength in STRENGTHS:
        merged_node = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength,
                               apply_mode="merge")[0]
        comfy.model_management.unload_all_models()
        assert_weights_match(weights_after_full_load(merged_node, list(base)), base, truth, strength)
        bypassed = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength,
                            apply_mode="bypass")[0]
        comfy.model_management.unload_all_models()
        assert_weights_match(bypassed_weights(bypassed, base, truth), base, truth, strength)
    comfy.model_management.unload_all_models()


def bypassed_weights(patcher, base: dict, truth: dict) -> dict[str, torch.Tensor]:
    """The stored weights after a full load, which a bypass leaves as they were, the adapted ones replaced by what
    their layer computes with (its output on the identity)."""
    patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=0)
    try:
        state = patcher.model.state_dict()
        got = {k: state[k].detach().clone() for k in base}
        assert all(torch.equal(got[k], base[k]) for k in truth), "a bypass changed a stored weight"
        with torch.no_grad():
            for key in truth:
                layer = patcher.model.get_submodule(key[: -len(".weight")])
                got[key] = effective_weight(layer)
        return got
    finally:
        patcher.unpatch_model(torch.device("cpu"))


# diffusers' AceStepTransformer1DModel at the tiny widths above, one block
DIFFUSERS_TWIN = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 32, "encoder_hidden_size": 64}
DIFFUSERS_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", *MLP, "condition_embedder", "time_proj"]


def diffusers_paths(patcher) -> dict[str, str]:
    """diffusers' name -> ComfyUI's decoder path of each decoder parameter, by diffusers' own LoRA converter."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ace_step_lora_to_diffusers

    paths = {}
    for key in decoder(patcher).state_dict():
        (converted,) = _convert_non_diffusers_ace_step_lora_to_diffusers({f"base_model.model.{key}": None})
        paths[converted.removeprefix("transformer.")] = key
    return paths


@pytest.fixture(scope="module")
def diffusers_twin(acestep):
    paths = diffusers_paths(acestep)
    state = decoder(acestep).state_dict()
    twin = diffusers.AceStepTransformer1DModel(**DIFFUSERS_TWIN).float().requires_grad_(False)
    loaded = twin.load_state_dict({name: state[key] for name, key in paths.items()}, strict=False)
    linear = {f"{n}.weight" for n in linear_names(twin)}
    assert linear and not linear & set(loaded.missing_keys), loaded.missing_keys  # every Linear is ComfyUI's
    return twin, paths


def test_diffusers_file_applies_fully_and_equal_to_peft_merge(acestep, diffusers_twin, loras, tmp_path):
    twin, paths = diffusers_twin
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=DIFFUSERS_TARGETS)
    model = adapted(twin, config, "save_lora_weights", seed=SEED)
    name = "acestep-diffusers.safetensors"
    diffusers.AceStepPipeline.save_lora_weights(
        str(tmp_path), transformer_lora_layers=peft.get_peft_model_state_dict(model), weight_name=name,
        transformer_lora_adapter_metadata=config.to_dict())
    written = {name: (tmp_path / name).read_bytes()}
    assert {"transformer.layers.0.self_attn.to_q.lora_A.weight", "transformer.condition_embedder.lora_B.weight",
            "transformer.layers.0.cross_attn.to_out.0.lora_A.weight"} <= file_keys(written)
    merged = {paths[n]: value for n, value in merged_parameters(model).items()}
    check_file(acestep, loras, written, merged)


def file_keys(written: dict[str, bytes]) -> set[str]:
    from safetensors.torch import load

    return set(load(next(iter(written.values()))))


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_official_peft_file_applies_fully_and_equal_to_peft_merge(case, acestep, files, loras):
    written, merged = files(case)
    keys = file_keys(written)
    assert all(k.startswith("base_model.model.layers.") for k in keys)
    assert "base_model.model.layers.0.cross_attn.o_proj.lora_A.weight" in keys and not any("alpha" in k for k in keys)
    config = json.loads(written[f"{case}/adapter_config.json"])
    assert (config["lora_alpha"], config["use_rslora"]) == (PEFT_CASES[case].lora_alpha, PEFT_CASES[case].use_rslora)
    check_file(acestep, loras, written, merged)


@pytest.mark.parametrize("case", list(LYCORIS_CASES))
def test_lycoris_lokr_file_applies_fully_and_equal_to_its_forward(case, acestep, files, loras):
    written, merged = files(case)
    keys = file_keys(written)
    modules = {k.split(".", 1)[0] for k in keys}
    # split w2 on every module (the case the file of #12638 has); DoRA's scale where asked
    assert {k for k in keys if k.endswith(".lokr_w2_a")} == {f"{m}.lokr_w2_a" for m in modules}
    assert not any(k.endswith(".lokr_w2") for k in keys)
    dora = LYCORIS_CASES[case][0].get("dora_wd", False)
    assert {k for k in keys if k.endswith(".dora_scale")} == ({f"{m}.dora_scale" for m in modules} if dora else set())
    if LYCORIS_CASES[case][0].get("decompose_both"):
        assert {k for k in keys if k.endswith(".lokr_w1_a")} == {f"{m}.lokr_w1_a" for m in modules}
    if LYCORIS_CASES[case][1] is None:
        assert {"lycoris_layers_0_cross_attn_k_proj.lokr_w2_a", "lycoris_condition_embedder.dora_scale",
                "lycoris_time_embed_r_time_proj.lokr_w2_a", "lycoris_layers_0_mlp_down_proj.dora_scale"} <= keys
    check_file(acestep, loras, written, merged)
