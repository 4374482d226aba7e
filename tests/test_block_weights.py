"""Block weights: the text (named rules, A1111/Inspire LBW vectors), presets, block names on real ComfyUI key sets, and
exactness through LyCORIS Loader (Block Weights) on the tiny real SD1.5.

Truth never comes from our own code:
* parsing: expected weights written by hand per key; LBW vectors against the webui's block ID lists (BLOCKID17/26,
  BLOCKID12/20 of sd-webui-lora-block-weight, missing blocks of the 17/12-forms at 1 as the webui expands them) and
  the ldm key names (`input_blocks.N` = INnn, `middle_block` = M00, `output_blocks.N` = OUTnn, text encoder = BASE);
* block names: key sets of ComfyUI's own model classes built on the `meta` device, expected names per architecture
  written here;
* exactness: real lycoris-lora 4.1.3 networks built on float64 copies of the tiny SD1.5's own layers, each module's
  multiplier set to strength × block weight (`lora.multiplier = m`), the effective weight read off the reference
  forward pass with unit inputs;
* documented equivalences (an LBW vector and its named rules, uniform block weights and the plain loader) compare two
  paths bitwise.
"""

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field

import comfy.model_management
import comfy.ops
import comfy.utils
import folder_paths
import pytest
import test_nodes
import torch
from comfy_env import REPO_ROOT
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.block_weights import parse
from lycoris_nodes.lycoris_core.blocks import block_of
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.inspection.block_info import LycorisBlockInfo
from lycoris_nodes.nodes.loading import presets
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from node_runner import execute
from patcher_util import assert_rounded_from
from reference.lycoris_factory import Lazy, _class_presets_restored, _randomise, attach, plain_copy
from safetensors.torch import load_file, save_file
from test_nodes import TE_Q, TO_Q, lora, weights_after_full_load, write

sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras

F64 = torch.float64


@pytest.fixture(autouse=True)
def no_panel_measurement(monkeypatch):
    """The loaders measure per-block change for their panel on every run (about one more patch pass); nothing here
    reads it, so it is skipped to keep these tests fast (test_coverage.py covers it)."""
    monkeypatch.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)


def loaded_weights(patcher, keys) -> dict[str, torch.Tensor]:
    """weights_after_full_load, after unloading everything: a patcher ComfyUI loaded earlier (the checkpoint's own CLIP
    patcher) marks its modules as patched, and a clone's patch_model() then skips them (load_models_gpu unloads the
    other patcher first; this does the same)."""
    comfy.model_management.unload_all_models()
    return weights_after_full_load(patcher, keys)


def run(cls, **inputs):
    """A node's outputs, executed the way ComfyUI's executor does (combo values checked against the schema)."""
    return execute(cls, **inputs).result


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().flatten().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- parsing ---------------------------------------------------------------------------------------------------------

K = {
    "in0": "diffusion_model.input_blocks.0.0.weight",
    "in1": "diffusion_model.input_blocks.1.1.proj_in.weight",
    "in4": "diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight",
    "in8": "diffusion_model.input_blocks.8.0.in_layers.2.weight",
    "in9": "diffusion_model.input_blocks.9.0.op.weight",
    "in10": "diffusion_model.input_blocks.10.0.in_layers.2.weight",
    "mid": "diffusion_model.middle_block.1.proj_in.weight",
    "out0": "diffusion_model.output_blocks.0.0.in_layers.2.weight",
    "out3.0": "diffusion_model.output_blocks.3.0.skip_connection.weight",
    "out3.1": "diffusion_model.output_blocks.3.1.proj_out.weight",
    "out11": "diffusion_model.output_blocks.11.1.proj_out.weight",
    "time": "diffusion_model.time_embed.0.weight",
    "double0": "diffusion_model.double_blocks.0.img_attn.qkv.weight",
    "double1": "diffusion_model.double_blocks.1.txt_mlp.0.weight",
    "double2": "diffusion_model.double_blocks.2.img_attn.proj.weight",
    "single10": "diffusion_model.single_blocks.10.linear1.weight",
    "clip_l": "clip_l.transformer.text_model.encoder.layers.5.mlp.fc1.weight",
    "clip_g": "clip_g.transformer.text_model.encoder.layers.20.self_attn.q_proj.weight",
    "t5": "t5xxl.transformer.encoder.block.3.layer.0.SelfAttention.q.weight",
}
TE = ("clip_l", "clip_g", "t5")
OUT = ("out0", "out3.0", "out3.1", "out11")

# (id, text, {key: weight}, weight of every other key of K)
PARSE_CASES = [
    ("readme", "default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8",
     {"in4": 0.5, "in8": 0.5, **dict.fromkeys(OUT, 0.0), **dict.fromkeys(TE, 0.8)}, 1.0),
    ("empty", "", {}, 1.0),
    ("only-comments", "# nothing here\n   \n;;", {}, 1.0),
    ("default-only", "default=0.25", {}, 0.25),
    ("default-is-for-unmatched-wherever-written", "te=1; default=0", dict.fromkeys(TE, 1.0), 0.0),
    ("last-rule-wins", "output_blocks=0\noutput_blocks.3=2", {"out0": 0.0, "out11": 0.0, "out3.0": 2.0, "out3.1": 2.0},
     1.0),
    ("last-rule-wins-reversed", "output_blocks.3=2; output_blocks=0", dict.fromkeys(OUT, 0.0), 1.0),
    ("wildcard-inside", "output_blocks.*.1=0", {"out3.1": 0.0, "out11": 0.0}, 1.0),
    ("range-inclusive", "input_blocks.1-4=3", {"in1": 3.0, "in4": 3.0}, 1.0),
    ("whole-components-not-string-prefix", "input_blocks.1=0", {"in1": 0.0}, 1.0),  # not input_blocks.10
    ("te-and-one-encoder", "te=0.5; te.clip_g=0", {"clip_l": 0.5, "t5": 0.5, "clip_g": 0.0}, 1.0),
    ("comments-newlines-semicolons", "# header\n input_blocks.4 = 0.5  # inline\n\n;;middle_block=0;\r\nte=2 # end",
     {"in4": 0.5, "mid": 0.0, **dict.fromkeys(TE, 2.0)}, 1.0),
    ("flux-names", "double_blocks.0-1=0; single_blocks.*=0.5", {"double0": 0.0, "double1": 0.0, "single10": 0.5}, 1.0),
    ("negative-and-exponent", "te=-1; middle_block=-5e-1; default=2.5E0", {**dict.fromkeys(TE, -1.0), "mid": -0.5}, 2.5),
    ("longer-pattern-than-key", "time_embed.0.weight.extra=0", {}, 1.0),
]


@pytest.mark.parametrize("text,expected,others", [pytest.param(*c[1:], id=c[0]) for c in PARSE_CASES])
def test_named_rules(text, expected, others):
    weights = parse(text)
    got = {name: weights.weight_for(key) for name, key in K.items()}
    assert got == {name: expected.get(name, others) for name in K}


@pytest.mark.parametrize("text,message", [
    ("input_blocks.4=abc", "'abc' is not a number"),
    ("input_blocks.4=", "'' is not a number"),
    ("=0.5", "not 'block=weight'"),
    ("default=one", "'one' is not a number"),
    ("1,1,1", "has 3 numbers.*17.*26.*12.*20"),
    ("0.5", "has 1 numbers"),
    (",".join(["1"] * 18), "has 18 numbers"),
    (",".join(["1"] * 8 + ["x"] + ["1"] * 8), "'x' is not a number"),
])
def test_bad_text_is_a_clear_error(text, message):
    with pytest.raises(LycorisError, match=message):
        parse(text)


@pytest.mark.parametrize("text", ["default=nan", "te=inf", "input_blocks.1=-inf", "middle_block=1e999",
                                  ",".join(["1"] * 16 + ["nan"])])
def test_non_finite_block_weight_is_an_error(text):
    """A non-finite block weight ('nan', 'inf', '1e999', which float() accepts) is a LycorisError when parsed, so no
    NaN/inf strength reaches add_patches and the model's weights (once let through by float())."""
    with pytest.raises(LycorisError):
        parse(text)


# The webui's block IDs per vector length (sd-webui-lora-block-weight BLOCKID17/26/12/20).
def _ids(prefix: str, indices) -> list[str]:
    return [f"{prefix}{i:02d}" for i in indices]


A1111 = {
    17: ["BASE", *_ids("IN", (1, 2, 4, 5, 7, 8)), "M00", *_ids("OUT", range(3, 12))],
    26: ["BASE", *_ids("IN", range(12)), "M00", *_ids("OUT", range(12))],
    12: ["BASE", *_ids("IN", (4, 5, 7, 8)), "M00", *_ids("OUT", range(6))],
    20: ["BASE", *_ids("IN", range(9)), "M00", *_ids("OUT", range(9))],
}
_LDM = re.compile(r"diffusion_model\.(input_blocks|middle_block|output_blocks)\.(\d+)\.")


def a1111_block(key: str) -> str | None:
    """The webui block a ComfyUI key belongs to: BASE for the text encoder, INnn/M00/OUTnn by ldm name, else none."""
    if not key.startswith("diffusion_model."):
        return "BASE"
    m = _LDM.match(key)
    if m is None:
        return None
    return {"input_blocks": f"IN{int(m[2]):02d}", "middle_block": "M00", "output_blocks": f"OUT{int(m[2]):02d}"}[m[1]]


SD15_UNET = {  # ComfyUI's SD1.5 UNet (the structure model detection reads from an SD1.5 checkpoint)
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
    "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8, "num_head_channels": -1,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
SDXL_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "in_channels": 4, "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4],
    "transformer_depth_middle": 10, "num_head_channels": 64, "use_temporal_resblock": False,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
}


def _unet_keys(config: dict, family: str) -> list[str]:
    import comfy.model_detection
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    detected = comfy.model_detection.model_config_from_unet_config(config)
    assert type(detected).__name__ == family, f"ComfyUI detects {type(detected).__name__}, not {family}"
    unet = UNetModel(**config, device="meta", operations=comfy.ops.disable_weight_init)
    return [f"diffusion_model.{k}" for k in unet.state_dict()]


@pytest.fixture(scope="module")
def key_sets(sd15):
    """Real ComfyUI weight keys: full-size SD1.5 and SDXL UNets (meta device) and the tiny SD1.5's CLIP-L."""
    import comfy.supported_models

    clip_keys = list(sd15[1].cond_stage_model.state_dict())
    sdxl = {**SDXL_UNET, **comfy.supported_models.SDXL.unet_config}  # the detection keys, transformer depths
    return {"SD15": _unet_keys({**SD15_UNET, **comfy.supported_models.SD15.unet_config}, "SD15") + clip_keys,
            "SDXL": _unet_keys(sdxl, "SDXL") + clip_keys}


@pytest.mark.parametrize("size,family", [(17, "SD15"), (26, "SD15"), (12, "SDXL"), (20, "SDXL")])
def test_lbw_vector_maps_to_webui_blocks(size, family, key_sets):
    keys = key_sets[family]
    ids = A1111[size]
    present = {a1111_block(k) for k in keys}
    assert set(ids) <= present, f"blocks missing from {family}: {set(ids) - present}"
    values = [(i + 1) / 32 for i in range(size)]  # distinct, so a block read from the wrong position shows
    for text in (",".join(map(str, values)), ", ".join(map(str, values)) + ",\n"):
        weights = parse(text)
        for key in keys:
            block = a1111_block(key)
            expected = values[ids.index(block)] if block in ids else 1.0  # webui: blocks not in the vector at 1
            assert weights.weight_for(key) == expected, (key, block)


def test_lbw_17_equals_26_with_ones_where_17_has_no_block(key_sets):
    values17 = [(i + 1) / 32 for i in range(17)]
    expanded = [values17[A1111[17].index(b)] if b in A1111[17] else 1.0 for b in A1111[26]]
    short, full = parse(",".join(map(str, values17))), parse(",".join(map(str, expanded)))
    assert all(short.weight_for(k) == full.weight_for(k) for k in key_sets["SD15"])


def test_lbw_vector_and_named_rules_combine_in_order():
    text = "\n".join([",".join(["0"] * 17), "input_blocks.4=0.5", "te=1"])  # vector first, refinements after
    weights = parse(text)
    assert weights.weight_for(K["in4"]) == 0.5 and weights.weight_for(K["clip_l"]) == 1.0
    assert weights.weight_for(K["mid"]) == 0.0 and weights.weight_for(K["out11"]) == 0.0
    assert weights.weight_for(K["in0"]) == 1.0  # IN00 is not in the 17-form


# --- presets -----------------------------------------------------------------------------------------------------------

SHIPPED = json.loads((REPO_ROOT / "presets" / "block_weights.json").read_text(encoding="utf-8"))
SHIPPED_NAMES = [name for name in SHIPPED if not name.startswith("_")]


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    folder = tmp_path / "user"
    folder.mkdir()
    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(folder))
    return folder


def _user_presets(user_dir, content: str | bytes):
    path = user_dir / "lycoris_nodes" / "block_weight_presets.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def test_every_shipped_preset_parses_and_is_offered(user_dir):
    assert presets.preset_names() == ["custom", *SHIPPED_NAMES]
    for name in SHIPPED_NAMES:
        parse(presets.block_weight_text(name, ""))
    options = LycorisBlockWeights.INPUT_TYPES()["optional"]["preset"][1]["options"]
    assert options == ["custom", *SHIPPED_NAMES]


@pytest.mark.parametrize("preset,expected,others", [
    ("ALL", {}, 1.0),
    ("NONE", {}, 0.0),
    ("UNet only (no text encoder)", dict.fromkeys(TE, 0.0), 1.0),
    ("Text encoder only", dict.fromkeys(TE, 1.0), 0.0),
    ("UNet: no input blocks", {"in0": 0.0, "in1": 0.0, "in4": 0.0, "in8": 0.0, "in9": 0.0, "in10": 0.0}, 1.0),
    ("UNet: no output blocks", dict.fromkeys(OUT, 0.0), 1.0),
    ("UNet: middle only", {"mid": 1.0}, 0.0),
    ("Flux: double blocks only", {"single10": 0.0}, 1.0),
    ("Flux: single blocks only", {"double0": 0.0, "double1": 0.0, "double2": 0.0}, 1.0),
    # SD1.5 LBW INS = 1,1,1,1,1,1,1,0,...: BASE and IN01..IN08 on, MID and OUT03..11 off, IN00/IN09/10/OUT00-02 at 1
    ("SD1.5 LBW INS", {"mid": 0.0, "out3.0": 0.0, "out3.1": 0.0, "out11": 0.0}, 1.0),
    # SD1.5 LBW OUTALL = 1,0,0,0,0,0,0,1,1,...: IN01..IN08 off
    ("SD1.5 LBW OUTALL", {"in1": 0.0, "in4": 0.0, "in8": 0.0}, 1.0),
    # SDXL LBW OUTALL = 1,0,0,0,0,1,1,1,1,1,1,1: IN04/05/07/08 off
    ("SDXL LBW OUTALL", {"in4": 0.0, "in8": 0.0}, 1.0),
])
def test_shipped_preset_meaning(preset, expected, others, user_dir):
    weights = parse(presets.block_weight_text(preset, ""))
    assert {n: weights.weight_for(k) for n, k in K.items()} == {n: expected.get(n, others) for n in K}


def test_user_presets_extend_and_override(user_dir):
    _user_presets(user_dir, json.dumps({"_comment": "mine", "ALL": "default=0.5", "Mine": "te=0; output_blocks=2"}))
    names = presets.preset_names()
    assert names == ["custom", *SHIPPED_NAMES, "Mine"]  # the shipped ALL keeps its place, overridden
    assert "_comment" not in names
    assert parse(presets.block_weight_text("ALL", "")).weight_for(K["in4"]) == 0.5
    mine = parse(presets.block_weight_text("Mine", "output_blocks.3=1"))  # the text refines the preset
    assert (mine.weight_for(K["clip_l"]), mine.weight_for(K["out0"]), mine.weight_for(K["out3.1"])) == (0.0, 2.0, 1.0)
    assert "Mine" in LycorisBlockWeights.INPUT_TYPES()["optional"]["preset"][1]["options"]
    with pytest.raises(LycorisError, match="no block weight preset named 'Nope'"):
        presets.block_weight_text("Nope", "")


@pytest.mark.parametrize("content", ['{"Mine": "te=0",}', "[1, 2]", b'{"Mine": "te=0 \xff"}'],
                         ids=["trailing-comma", "not-an-object", "not-utf8"])
def test_broken_user_presets_are_an_error_naming_the_file(content, user_dir):
    path = _user_presets(user_dir, content)
    with pytest.raises(LycorisError) as err:
        presets.presets()
    assert str(path) in str(err.value)
    with pytest.raises(LycorisError) as err:
        presets.block_weight_text("Mine", "")
    assert str(path) in str(err.value)


def test_broken_user_presets_do_not_hide_the_node(user_dir):
    """A broken block_weight_presets.json leaves the schema (/object_info, prompt validation) intact: the preset combo
    still lists 'custom' and the shipped presets, so LyCORIS Loader (Block Weights) stays in the node library (it once
    vanished on one typo in the user file)."""
    _user_presets(user_dir, '{"Mine": "te=0",}')
    options = LycorisBlockWeights.INPUT_TYPES()["optional"]["preset"][1]["options"]
    assert options[: len(SHIPPED_NAMES) + 1] == ["custom", *SHIPPED_NAMES]


# --- block names on real key sets ------------------------------------------------------------------------------------

def _meta_models() -> dict[str, list[str]]:
    from comfy.ldm.flux.model import Flux, FluxParams
    from comfy.ldm.lumina.model import NextDiT
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    from comfy.ldm.wan.model import WanModel

    ops = comfy.ops.disable_weight_init
    # 0.33's Flux also takes the text position-id layout (Flux 2 / Chroma variants); 0.3.75's has no such field
    flux_new = {"txt_ids_dims": []} if "txt_ids_dims" in {f.name for f in dataclasses.fields(FluxParams)} else {}
    models = {
        "flux": Flux(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64, mlp_ratio=2.0,
                     num_heads=4, depth=3, depth_single_blocks=4, axes_dim=[4, 6, 6], theta=10000, patch_size=2,
                     qkv_bias=True, guidance_embed=True, device="meta", operations=ops, **flux_new),
        "sd3": MMDiT(input_size=None, patch_size=2, in_channels=16, depth=3, adm_in_channels=64,
                     context_embedder_config={"target": "torch.nn.Linear",
                                              "params": {"in_features": 32, "out_features": 192}},
                     pos_embed_max_size=16, num_patches=256, out_channels=16, device="meta", operations=ops),
        "wan": WanModel(dim=64, ffn_dim=128, freq_dim=32, text_dim=32, num_heads=4, num_layers=3, in_dim=16,
                        out_dim=16, device="meta", operations=ops),
        # an architecture block_of knows nothing about: Lumina 2's NextDiT (layers.N, noise_refiner.N, …)
        "lumina": NextDiT(patch_size=2, in_channels=4, dim=64, n_layers=3, n_refiner_layers=1, n_heads=4,
                          multiple_of=16, cap_feat_dim=32, axes_dims=(4, 6, 6), axes_lens=(1, 8, 8), device="meta",
                          operations=ops),
    }
    with torch.device("meta"):  # a made-up model: numbered containers at the top and one level down
        made_up = torch.nn.Module()
        made_up.stages = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(3)])
        made_up.encoder = torch.nn.Module()
        made_up.encoder.layer = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        made_up.head = torch.nn.Linear(4, 4)
    models["made_up"] = made_up
    return {name: [f"diffusion_model.{k}" for k in m.state_dict()] for name, m in models.items()}


# architecture -> (the numbered containers its blocks live in, a rule, the blocks that rule must select)
ARCH = {
    "flux": (("double_blocks", "single_blocks"), "double_blocks.0-1=0", ("double_blocks.0", "double_blocks.1")),
    "sd3": (("joint_blocks",), "joint_blocks.1=0", ("joint_blocks.1",)),
    "wan": (("blocks",), "blocks.0-1=0", ("blocks.0", "blocks.1")),
    "lumina": (("layers", "noise_refiner", "context_refiner"), "layers.*=0; noise_refiner=0",
               ("layers.0", "layers.1", "layers.2", "noise_refiner.0")),
    "made_up": (("stages", "encoder.layer"), "stages.2=0; encoder.layer.0=0", ("stages.2", "encoder.layer.0")),
}
BLOCK_COUNTS = {"flux": {"double_blocks": 3, "single_blocks": 4}, "sd3": {"joint_blocks": 3}, "wan": {"blocks": 3},
                "lumina": {"layers": 3, "noise_refiner": 1, "context_refiner": 1},
                "made_up": {"stages": 3, "encoder.layer": 2}}


@pytest.fixture(scope="module")
def meta_keys():
    return _meta_models()


@pytest.mark.parametrize("arch", list(ARCH))
def test_block_names_and_rules_on_dit_key_sets(arch, meta_keys):
    keys = meta_keys[arch]
    containers, rule, selected_blocks = ARCH[arch]
    found = {}
    for key in keys:
        path = key.removeprefix("diffusion_model.")
        container = next((c for c in containers if path.startswith(c + ".")), None)
        if container is not None:
            index = path[len(container) + 1:].split(".")[0]
            assert index.isdigit(), key
            assert block_of(key) == f"{container}.{index}", key
            found.setdefault(container, set()).add(int(index))
        else:  # outside the numbered containers: a prefix of its own path, never one of the blocks
            name = block_of(key)
            assert (path == name or path.startswith(name + ".")) and not name.startswith(containers), (key, name)
    assert {c: len(ix) for c, ix in found.items()} == BLOCK_COUNTS[arch]
    assert all(ix == set(range(len(ix))) for ix in found.values())

    weights = parse(rule)
    selected = {k for k in keys if weights.weight_for(k) == 0}
    expected = {k for k in keys if k.removeprefix("diffusion_model.").startswith(tuple(b + "." for b in selected_blocks))}
    assert selected == expected and expected


def test_block_names_on_tiny_sd15(sd15):
    model, clip = sd15
    unet = [k for k in model.model.state_dict() if k.startswith("diffusion_model.")]
    expected_unet = {"input_blocks.0", "input_blocks.1", "middle_block.0", "middle_block.1", "middle_block.2",
                     "output_blocks.0", "output_blocks.1", "time_embed.0", "time_embed.2", "out.0", "out.2"}
    assert {block_of(k) for k in unet} == expected_unet
    for key in unet:
        m = _LDM.match(key)
        if m:
            assert block_of(key) == f"{m[1]}.{m[2]}", key
    te_layer = re.compile(r"clip_l\.transformer\.text_model\.encoder\.layers\.(\d+)\.")
    for key in clip.cond_stage_model.state_dict():
        m = te_layer.match(key)
        assert block_of(key) == (f"te.clip_l.layers.{m[1]}" if m else "te.clip_l"), key


def test_sdxl_transformer_blocks_are_where_sdxl_has_attention(key_sets):
    """SDXL has attention in its 2nd and 3rd levels only: input_blocks 4, 5, 7, 8, the middle and output_blocks 0-5 —
    exactly the blocks of the 12-number LBW form."""
    unet = [k for k in key_sets["SDXL"] if k.startswith("diffusion_model.")]
    with_attention = {block_of(k) for k in unet if ".transformer_blocks." in k}
    assert with_attention == {*(f"input_blocks.{i}" for i in (4, 5, 7, 8)), "middle_block.1",
                              *(f"output_blocks.{i}" for i in range(6))}
    assert {block_of(k) for k in unet if k.startswith("diffusion_model.input_blocks.")} == \
        {f"input_blocks.{i}" for i in range(9)}


@pytest.mark.parametrize("arch", ["SD15", "SDXL", *ARCH])
def test_a_listed_block_name_works_as_a_rule(arch, key_sets, meta_keys):
    """LyCORIS Block Info lists blocks by block_of() as 'the names to use in block weights': `<name>=0` must select
    exactly the keys of that block and of the blocks listed under it (`final_layer` also covers
    `final_layer.adaLN_modulation.1`, `te.clip_l` the whole encoder), on every architecture, the text encoders'
    short names such as `te.clip_l.layers.5` included (those once selected nothing)."""
    keys = key_sets[arch] if arch in key_sets else meta_keys[arch]
    by_block: dict[str, set[str]] = {}
    for key in keys:
        by_block.setdefault(block_of(key), set()).add(key)
    wrong = []
    for name in by_block:
        members = {k for b, ks in by_block.items() if b == name or b.startswith(name + ".") for k in ks}
        weights = parse(f"{name}=0")
        selected = {k for k in keys if weights.weight_for(k) == 0}
        if selected != members:
            wrong.append(f"{name}: selects {len(selected)} keys, the block has {len(members)}")
    assert not wrong, f"{len(wrong)} of {len(by_block)} listed blocks do not work as rules, e.g. " + "; ".join(wrong[:4])


# --- exactness against the LyCORIS reference, through the node -------------------------------------------------------

UNET_LAYERS = (  # layer paths in the UNet (reading a weight off the reference costs in²·out, so inputs stay small)
    "input_blocks.0.0",  # conv_in, 3x3 conv 4 -> 320, padding 1
    "input_blocks.1.1.transformer_blocks.0.attn1.to_q",  # Linear 320 -> 320, no bias
    "input_blocks.1.1.proj_in",  # 1x1 conv with bias
    "middle_block.1.transformer_blocks.0.attn2.to_k",  # Linear 768 -> 320
    "middle_block.1.proj_out",  # 1x1 conv
    "output_blocks.0.1.transformer_blocks.0.attn1.to_out.0",  # Linear 320 -> 320 with bias
    "output_blocks.1.1.proj_out",  # 1x1 conv
    "time_embed.0",  # Linear 320 -> 1280, in no block of any rule below
)
TE_LAYERS = ("text_model.encoder.layers.0.self_attn.q_proj", "text_model.encoder.layers.5.self_attn.v_proj")
ALGOS = {  # id -> (lycoris algo, kwargs, container dtype, DoRA/OFT: LyCORIS' multiplier differs from linear strength)
    "locon": ("lora", {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}, F64, False),
    "loha": ("loha", {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}, F64, False),
    "lokr_dora": ("lokr", {"linear_dim": 2, "linear_alpha": 1.5, "conv_dim": 2, "conv_alpha": 1.0, "dora_wd": True,
                           "wd_on_output": True}, F64, True),
    # Diag-OFT's Cayley transform cannot run in float64 in the reference (see lycoris_factory)
    "oft": ("diag-oft", {"linear_dim": 4, "conv_dim": 4}, torch.float32, True),
    "glora": ("glora", {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}, F64, False),
}


def model_key(path: str) -> str:
    side, rest = path.split(".", 1)
    return f"diffusion_model.{rest}.weight" if side == "unet" else f"clip_l.transformer.{rest}.weight"


@dataclass
class ReferenceFile:
    """A real lycoris-lora file for the tiny SD1.5's layers, and the reference network that made it."""

    algo_id: str
    file: str  # path of the saved file (kohya key names)
    net: object
    layers: dict  # "unet.<path>" / "te.<path>" -> the reference's float layer (its forward is the adapter's)
    w0: dict  # same keys -> the untouched weight, float64
    cache: dict = field(default_factory=dict)  # (path, m) -> the reference's weight at multiplier m

    def install(self, folder, name=None) -> str:
        name = name or f"{self.algo_id}.safetensors"
        shutil.copy(self.file, folder / name)
        return name

    @torch.no_grad()
    def weight(self, path: str, m: float, linear: bool) -> torch.Tensor:
        """The weight this module's reference forward uses at multiplier m; linear: W0 + m·(W(1) − W0)."""
        if linear and ALGOS[self.algo_id][3]:
            return self.w0[path] + m * (self.weight(path, 1.0, False) - self.w0[path])
        if (path, m) not in self.cache:
            (lora_module,) = [lo for lo in self.net.loras if lo.lora_name == "lycoris_" + path.replace(".", "_")]
            lora_module.multiplier = m
            try:
                self.cache[(path, m)] = effective_weight(self.layers[path])
            finally:
                lora_module.multiplier = 1.0
        return self.cache[(path, m)]


@torch.no_grad()
def effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight a Linear / stride-1 'same' Conv2d layer's forward uses, read off its response to unit inputs
    (y(e_i) − y(0); for a conv a unit impulse at the centre of a k×k input gives the flipped kernel)."""
    dtype = layer.weight.dtype
    if isinstance(layer, torch.nn.Linear):
        n = layer.in_features
        return (layer(torch.eye(n, dtype=dtype)) - layer(torch.zeros(1, n, dtype=dtype))).T.to(F64)
    c, (kh, kw) = layer.in_channels, layer.kernel_size
    assert layer.stride == (1, 1) and layer.padding == (kh // 2, kw // 2) and layer.groups == 1
    x = torch.zeros(c, c, kh, kw, dtype=dtype)
    x[range(c), range(c), kh // 2, kw // 2] = 1
    y = layer(x) - layer(torch.zeros(1, c, kh, kw, dtype=dtype))
    return y.transpose(0, 1).flip(2, 3).to(F64)


def make_reference(algo_id: str, model, clip, directory, seed: int = 0) -> ReferenceFile:
    """Builds the lycoris-lora network on float copies of the tiny SD1.5's layers (unet.*, te.*), sets seeded
    parameters, saves the file and renames its modules to the kohya names ComfyUI maps (lycoris_unet_* -> lora_unet_*,
    lycoris_te_* -> lora_te_*; the tensors are untouched)."""
    algo, kwargs, dtype, _ = ALGOS[algo_id]
    root = torch.nn.Module()
    layers, w0 = {}, {}
    sources = [("unet", model.model.diffusion_model, model.model.state_dict(), p) for p in UNET_LAYERS]
    sources += [("te", clip.cond_stage_model.clip_l.transformer, clip.cond_stage_model.state_dict(), p)
                for p in TE_LAYERS]
    for side, owner, sd, path in sources:
        key = model_key(f"{side}.{path}")
        copy = plain_copy(comfy.utils.get_attr(owner, path), sd[key], sd.get(key[: -len("weight")] + "bias"), dtype)
        attach(root, f"{side}.{path}", copy)
        layers[f"{side}.{path}"], w0[f"{side}.{path}"] = copy, sd[key].to(F64).clone()
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [],
                                     "name_algo_map": {re.escape(p) + "$": {} for p in layers}})
        net = create_lycoris(root, 1.0, warn_on_unmatched=False, algo=algo, **kwargs)
    assert len(net.loras) == len(layers), [lo.lora_name for lo in net.loras]
    for lora_module in net.loras:
        lora_module.to(dtype)
    _randomise(net, torch.Generator().manual_seed(20240601 + seed + sum(map(ord, algo_id))))
    net.apply_to()
    raw = directory / f"{algo_id}-{seed}.raw.safetensors"
    net.save_weights(str(raw), torch.float32, {})
    renamed = {k.replace("lycoris_unet_", "lora_unet_", 1).replace("lycoris_te_", "lora_te_", 1): v
               for k, v in load_file(str(raw)).items()}
    path = directory / f"{algo_id}-{seed}.safetensors"
    save_file(renamed, str(path))
    return ReferenceFile(algo_id, str(path), net, layers, w0)




@pytest.fixture(scope="module")
def reference(sd15, tmp_path_factory):
    directory = tmp_path_factory.mktemp("block_weight_reference")
    return Lazy(lambda algo_id: make_reference(algo_id, *sd15, directory))


@pytest.fixture(scope="module")
def originals(sd15):
    model, clip = sd15
    msd, csd = model.model.state_dict(), clip.cond_stage_model.state_dict()
    keys = [model_key(f"unet.{p}") for p in UNET_LAYERS] + [model_key(f"te.{p}") for p in TE_LAYERS]
    return {k: (msd[k] if k in msd else csd[k]).detach().clone() for k in keys}


# block weights text -> the weight of each layer, written by hand
CONFIGS = {
    "mixed": ("""
        default=0.5                # time_embed
        input_blocks.*=1.5
        input_blocks.0=-1          # after the wildcard: wins for conv_in
        middle_block=0             # left untouched
        output_blocks.0-1=2
        te=0.25
        """, {"input_blocks.0.0": -1.0, "input_blocks.1.1.transformer_blocks.0.attn1.to_q": 1.5,
              "input_blocks.1.1.proj_in": 1.5, "middle_block.1.transformer_blocks.0.attn2.to_k": 0.0,
              "middle_block.1.proj_out": 0.0, "output_blocks.0.1.transformer_blocks.0.attn1.to_out.0": 2.0,
              "output_blocks.1.1.proj_out": 2.0, "time_embed.0": 0.5, **dict.fromkeys(TE_LAYERS, 0.25)}),
    "no-te-no-output": ("te=0; output_blocks=0; input_blocks.1=0.5",
                        {**dict.fromkeys(UNET_LAYERS, 1.0), "input_blocks.1.1.transformer_blocks.0.attn1.to_q": 0.5,
                         "input_blocks.1.1.proj_in": 0.5, "output_blocks.0.1.transformer_blocks.0.attn1.to_out.0": 0.0,
                         "output_blocks.1.1.proj_out": 0.0, **dict.fromkeys(TE_LAYERS, 0.0)}),
}
STRENGTH_MODEL, STRENGTH_CLIP = 0.75, 2.0
EXACT_CASES = [("locon", "mixed", "linear"), ("locon", "no-te-no-output", "linear"), ("loha", "mixed", "linear"),
               ("lokr_dora", "mixed", "linear"), ("lokr_dora", "no-te-no-output", "linear"),
               ("oft", "mixed", "linear"), ("oft", "no-te-no-output", "linear"), ("glora", "mixed", "linear"),
               ("lokr_dora", "mixed", "lycoris"), ("oft", "mixed", "lycoris")]


def assert_matches_truth(got: torch.Tensor, truth: torch.Tensor, w0: torch.Tensor, what: str):
    assert float((truth - w0).norm() / w0.norm()) > 1e-3, f"{what}: the reference barely changes this weight"
    assert_rounded_from(got, truth, got.dtype, slack=3e-5, what=what)
    if got.dtype == torch.float32:  # and the change itself to 1e-4 (a wrong multiplier is off by its ratio)
        error = float((got.double() - truth).norm() / (truth - w0).norm())
        assert error < 1e-4, f"{what}: change off by {error:.2e} of itself"


@pytest.mark.parametrize("algo_id,config,mode", [pytest.param(*c, id="-".join(c)) for c in EXACT_CASES])
def test_block_weights_equal_reference_at_per_module_multiplier(algo_id, config, mode, sd15, loras, reference,
                                                                originals):
    model, clip = sd15
    ref = reference[algo_id]
    name = ref.install(loras)
    text, per_layer = CONFIGS[config]
    new_model, new_clip = run(LycorisBlockWeights, model=model, clip=clip, lycoris_name=name,
                              strength_model=STRENGTH_MODEL, strength_clip=STRENGTH_CLIP, block_weights=text,
                              preset="custom", strength_mode=mode)
    unet_keys = [model_key(f"unet.{p}") for p in UNET_LAYERS]
    te_keys = [model_key(f"te.{p}") for p in TE_LAYERS]
    got = {**loaded_weights(new_model, unet_keys), **loaded_weights(new_clip.patcher, te_keys)}
    checked = 0
    for side, layer_paths, strength in (("unet", UNET_LAYERS, STRENGTH_MODEL), ("te", TE_LAYERS, STRENGTH_CLIP)):
        for p in layer_paths:
            key, m = model_key(f"{side}.{p}"), strength * per_layer[p]
            what = f"{algo_id} {mode} {key} m={m:g}"
            if per_layer[p] == 0:  # documented: a block weighted 0 is left exactly as it is (in both modes)
                assert same_bits(got[key], originals[key]), f"{what}: a block weighted 0 changed"
                continue
            truth = ref.weight(f"{side}.{p}", m, linear=mode == "linear")
            assert_matches_truth(got[key], truth, ref.w0[f"{side}.{p}"], what)
            checked += 1
    assert checked >= 4
    comfy.model_management.unload_all_models()
    for key, value in originals.items():  # the input model and clip are untouched
        sd = model.model.state_dict() if key.startswith("diffusion_model.") else clip.cond_stage_model.state_dict()
        assert same_bits(sd[key], value), key


def _patched_weights(model, clip, lycoris_name, block_weights, preset="custom"):
    new_model, new_clip = run(LycorisBlockWeights, model=model, clip=clip, lycoris_name=lycoris_name,
                              strength_model=STRENGTH_MODEL, strength_clip=STRENGTH_CLIP,
                              block_weights=block_weights, preset=preset, strength_mode="linear")
    unet_keys = [model_key(f"unet.{p}") for p in UNET_LAYERS]
    te_keys = [model_key(f"te.{p}") for p in TE_LAYERS]
    return {**loaded_weights(new_model, unet_keys), **loaded_weights(new_clip.patcher, te_keys)}


def _vector(size: int, values: dict[str, float]) -> str:
    return ",".join(str(values.get(block, 1.0)) for block in A1111[size])


@pytest.mark.parametrize("size,named", [
    (26, "te=0.5; input_blocks.0=-1; input_blocks.1=1.5; middle_block=0; output_blocks.0=2; output_blocks.1=0.25"),
    (17, "te=0.5; input_blocks.1=1.5; middle_block=0"),  # IN00, OUT00, OUT01 are not in the 17-form: they stay 1
])
def test_lbw_vector_patches_bitwise_like_the_named_rules(size, named, sd15, loras, reference, originals):
    model, clip = sd15
    name = reference["lokr_dora"].install(loras)
    values = {"BASE": 0.5, "IN00": -1.0, "IN01": 1.5, "M00": 0.0, "OUT00": 2.0, "OUT01": 0.25}
    by_vector = _patched_weights(model, clip, name, _vector(size, values))
    by_name = _patched_weights(model, clip, name, named)
    plain = _patched_weights(model, clip, name, "")
    for key in by_vector:
        assert same_bits(by_vector[key], by_name[key]), key
    mid = model_key("unet.middle_block.1.proj_out")
    assert same_bits(by_vector[mid], originals[mid]) and not same_bits(plain[mid], originals[mid])
    te = model_key(f"te.{TE_LAYERS[0]}")
    assert not same_bits(by_vector[te], plain[te])  # BASE (0.5) did reach the text encoder


def test_preset_with_the_nodes_default_text(sd15, loras, originals):
    """A preset that sets `default` ('Text encoder only') keeps its effect beside the node's own default
    block_weights text 'default=1': the text encoder is patched and the diffusion model untouched (the node's
    `default=1` once overrode the preset's)."""
    model, clip = sd15
    name = write(loras, "unet_and_te.safetensors", {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2)})
    default_text = LycorisBlockWeights.INPUT_TYPES()["required"]["block_weights"][1]["default"]
    new_model, new_clip = run(LycorisBlockWeights, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                              strength_clip=1.0, block_weights=default_text, preset="Text encoder only")
    assert new_clip.patcher.patches, "the text encoder should be patched"
    assert not new_model.patches, f"the diffusion model should be untouched, got patches on {list(new_model.patches)}"


def test_block_weights_node_equals_loader_when_uniform(sd15, loras):
    model, clip = sd15
    name = write(loras, "uniform.safetensors", {**lora(TO_Q, 320, 320, seed=3), **lora(TE_Q, 768, 768, seed=4)})
    keys = ["diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"]
    te_keys = ["clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"]
    m1, c1 = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.7, strength_clip=-0.3)
    for text, preset in (("default=1", "custom"), ("", "ALL"), ("", "custom")):
        m2, c2 = run(LycorisBlockWeights, model=model, clip=clip, lycoris_name=name, strength_model=0.7,
                     strength_clip=-0.3, block_weights=text, preset=preset)
        for a, b, k in ((m1, m2, keys), (c1.patcher, c2.patcher, te_keys)):
            wa, wb = loaded_weights(a, k), loaded_weights(b, k)
            assert all(same_bits(wa[x], wb[x]) for x in k)


def test_block_info_lists_names_that_work_as_rules(sd15, loras):
    """LyCORIS Block Info: one line per touched block; weighting a listed name 0 makes exactly that block's change 0,
    text-encoder blocks included (see test_a_listed_block_name_works_as_a_rule)."""
    model, clip = sd15
    te5 = "lora_te_text_model_encoder_layers_5_mlp_fc1"
    mid = "lora_unet_middle_block_1_proj_out"
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(mid, 320, 320, seed=2, kernel=(1, 1)),
          **lora(TE_Q, 768, 768, seed=3), **lora(te5, 3072, 768, seed=4)}
    name = write(loras, "blocks.safetensors", sd)

    def blocks(text):
        (out,) = run(LycorisBlockInfo, lycoris_name=name, model=model, clip=clip, strength=1.0, block_weights=text)
        rows = [re.fullmatch(r"(\S+): (\d+) modules, change ([\d.e-]+)", line) for line in out.splitlines()]
        assert all(rows), out
        return {r[1]: (int(r[2]), float(r[3])) for r in rows}

    listed = blocks("")
    assert set(listed) == {"input_blocks.1", "middle_block.1", "te.clip_l.layers.0", "te.clip_l.layers.5"}
    assert all(n == 1 and change > 0 for n, change in listed.values())
    not_zeroed = []
    for block in listed:
        weighted = blocks(f"{block}=0")
        if weighted[block][1] != 0.0:
            not_zeroed.append(block)
        assert {b: v for b, v in weighted.items() if b != block} == {b: v for b, v in listed.items() if b != block}
    assert not not_zeroed, f"'<name>=0' did not zero these listed blocks: {not_zeroed}"
