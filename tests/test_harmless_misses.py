"""Misses told apart from failures (issue #34): a module the model lacks by design is reported as "not in this model
(harmless)" with the reason, never counted as a failure, while everything else that does not apply stays a named
failure.

- A Wan 2.1 I2V file written by real tools (diffusers' `WanPipeline.save_lora_weights` over PEFT, and lycoris-lora's
  `create_lycoris` saved as SimpleTuner saves it; tests/test_video_dit_peft.py builds both over diffusers' Wan I2V
  model, the twin of ComfyUI's WAN21_I2V at a tiny width) on ComfyUI's tiny WAN21_T2V: every other module applies
  within 1e-4 of the truth (PEFT's merge / the LyCORIS network's forward, float64; a LoRA's change does not depend
  on W, so the I2V twin's change is the T2V model's), the image cross-attention modules are harmless with the reason,
  in the coverage line, the JSON, and the console at info level. The same file on the I2V model applies 100%.
- ComfyUI-named I2V modules as ai-toolkit and musubi-tuner write them, on ComfyUI's Wan models on the meta device;
  broken names (a block the model has not, another width, a misspelling, a non-Wan model) stay failures.
- LTX-2's audio branch on a video-only LTX-Video (ComfyUI's LTXV), applied on LTX-2 (LTXAV, 0.33 only).
- Text-encoder modules with no CLIP connected; a file that applies nothing but harmless misses still says so plainly.
- The panel's coverage box (web/panel/view.js) under Node with a minimal DOM: harmless misses listed in the neutral
  colour, and alone they do not make the box amber.
"""

import json
import logging
import shutil
import subprocess
from pathlib import Path

import comfy.model_management
import comfy.supported_models as supported
import diffusers  # noqa: F401  (an oracle of this module: its import error is a failure, not a skip)
import peft  # noqa: F401  (an oracle of this module: its import error is a failure, not a skip)
import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core import LycorisError, parse_state_dict
from lycoris_nodes.nodes.glue.apply import NO_SUCH_WEIGHT, build_patches, map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.coverage import BY_DESIGN, NO_CLIP, NOT_CONNECTED
from lycoris_nodes.nodes.glue.keymap import lora_key_map, model_shapes
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from reference.lycoris_factory import Lazy
from test_coverage import panel, run
from test_nodes import LOGGER, TE_Q, TO_Q, TO_Q_KEY, lora, run_node, weights_after_full_load, write
from test_peft_dit import put
from test_trainer_names import LORA, LTX2_CONFIG, LTXV_CONFIG, PEFT, WAN_CONFIG, WAN_I2V_CONFIG, _module
from test_video_dit_peft import build, lycoris_file, peft_file

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors
loras = test_nodes.loras
sd15 = test_nodes.sd15

WAN_WHAT = next(rule.what for rule in BY_DESIGN if rule.what.startswith("Wan"))
WAN_REASON = next(rule.reason for rule in BY_DESIGN if rule.what == WAN_WHAT)
LTX_WHAT = next(rule.what for rule in BY_DESIGN if rule.what.startswith("LTX-2"))
LTX_REASON = next(rule.reason for rule in BY_DESIGN if rule.what == LTX_WHAT)
TOLERANCE = 1e-4  # of the largest change of each weight, fp32
DIM = WAN_CONFIG["dim"]

# The sources of the ComfyUI-named I2V modules:
# ostris/ai-toolkit toolkit/models/wan21/wan_lora_convert.py convert_to_original (attn2 -> cross_attn, add_k_proj ->
# k_img, add_v_proj -> v_img, transformer. -> diffusion_model.; a836515), which toolkit/models/wan21/wan21.py's
# convert_lora_weights_before_save applies to the PEFT state dict (lora_A / lora_B) of its Wan 2.1 (and I2V) models.
AI_TOOLKIT_WAN = "ostris/ai-toolkit toolkit/models/wan21/wan_lora_convert.py convert_to_original"
# kohya-ss/musubi-tuner networks/lora_wan.py: prefix lora_unet + the model's own module path with dots as "_".
MUSUBI = "kohya-ss/musubi-tuner networks/lora_wan.py, lora.py (prefix lora_unet, the model's own module names)"
# bghira/SimpleTuner helpers/training/save_hooks.py: _save_lora (diffusers save_lora_weights, transformer. + diffusers
# path) and _save_lycoris (lycoris_ + diffusers path with dots as "_").
SIMPLETUNER = "bghira/SimpleTuner helpers/training/save_hooks.py _save_lora / _save_lycoris"


# --- a Wan 2.1 I2V file written by real tools, on ComfyUI's tiny Wan T2V and I2V -----------------------------------

@pytest.fixture(scope="module")
def wan():
    yield Lazy(build)  # "wan21-t2v" / "wan21-i2v": ComfyUI's model + its diffusers twin (tests/test_video_dit_peft.py)
    comfy.model_management.unload_all_models()


@pytest.fixture(scope="module")
def i2v_files(wan, tmp_path_factory):
    """source -> ({path: bytes}, {diffusers weight: (before, after)}) for a file made over the I2V twin."""
    folder = tmp_path_factory.mktemp("wan_i2v_files")

    def make(source):
        sub = folder / source
        sub.mkdir()
        if source == "peft":
            return peft_file(wan["wan21-i2v"], "lora", "save_lora_weights+metadata", sub)
        return lycoris_file(wan["wan21-i2v"], "lora", sub)

    return Lazy(make)


def image_modules(merged: dict) -> set[str]:
    return {name for name in merged if ".add_k_proj." in name or ".add_v_proj." in name}


def module_keys(report, names: set[str]) -> set[str]:
    """The report's module keys whose diffusers layer is one of `names` (PEFT: transformer.<path>; LyCORIS:
    lycoris_<path with _>)."""
    layers = {name.removesuffix(".weight") for name in names}
    forms = {f"transformer.{layer}.weight" for layer in layers} | {
        f"lycoris_{layer.replace('.', '_')}.weight" for layer in layers}
    return forms & (set(report.applied) | {k for k, _ in report.harmless} | {k for k, _ in report.problems})


@pytest.mark.parametrize("source", ["peft", "lycoris"])
def test_wan_i2v_file_on_t2v_applies_the_rest_and_calls_image_attention_harmless(source, wan, i2v_files, loras,
                                                                                 caplog):
    t2v = wan["wan21-t2v"]
    written, merged = i2v_files[source]
    image = image_modules(merged)
    assert len(image) == 4  # add_k_proj and add_v_proj in each of the 2 blocks
    name = put(loras, written)
    _, report = map_file(read(loras / name), t2v.patcher, None, reference=False)
    harmless = module_keys(report, image)
    assert len(harmless) == 4 and dict(report.harmless) == dict.fromkeys(harmless, WAN_REASON)
    assert report.problems == [] and report.unused_keys == [] and report.verdict == ""
    assert len(report.applied) == report.total - 4 == len(merged) - 4
    assert report.line().endswith(f", 4 not in this model (harmless: {WAN_WHAT})")
    data = report.to_json()
    assert data["problems"] == [] and data["harmless_what"] == {WAN_WHAT: 4}
    assert sorted(map(tuple, data["harmless"])) == sorted(report.harmless)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        patched = run_node(LycorisLoaderModelOnly, model=t2v.patcher, lycoris_name=name, strength_model=1.0)[0]
    ours = [r for r in caplog.records if r.name.startswith(LOGGER)]
    assert [r.levelno for r in ours if r.levelno >= logging.WARNING] == []
    assert any(r.levelno == logging.INFO and report.line() in r.getMessage() for r in ours)
    got = t2v.to_diffusers(weights_after_full_load(patched, t2v.keys))
    comfy.model_management.unload_all_models()
    assert set(got) == set(t2v.base) and not image & set(t2v.base)  # the T2V model has no add_k/v_proj at all
    changed = 0
    for key, value in got.items():
        if key not in merged:
            assert torch.equal(value, t2v.base[key]), key
            continue
        before, after = merged[key]
        change = after - before
        error = (value.double() - (t2v.base[key].double() + change)).abs().max()
        assert change.abs().max() > 0 and error <= TOLERANCE * change.abs().max(), f"{key}: {error:.3g}"
        changed += 1
    assert changed == len(merged) - 4


def test_the_same_file_on_wan_i2v_applies_fully(wan, i2v_files, loras):
    """Values on the I2V model: tests/test_video_dit_peft.py (the same PEFT and LyCORIS files' cases)."""
    for source in ("peft", "lycoris"):
        written, merged = i2v_files[source]
        _, report = map_file(read(loras / put(loras, written)), wan["wan21-i2v"].patcher, None, reference=False)
        assert report.harmless == [] and report.problems == [] and len(report.applied) == report.total == len(merged)
        assert "not in this model" not in report.line()


def test_a_file_of_only_image_attention_says_plainly_that_nothing_applies(wan, loras):
    """Harmless misses never hide that a file does nothing here: the loader refuses it, LyCORIS Info says 0 applied."""
    t2v = wan["wan21-t2v"]
    dim = t2v.patcher.model.diffusion_model.blocks[0].cross_attn.k.weight.shape[0]
    sd = {**_module("diffusion_model.blocks.0.cross_attn.k_img", PEFT, dim, (dim,)),  # AI_TOOLKIT_WAN
          **_module("diffusion_model.blocks.1.cross_attn.v_img", PEFT, dim, (dim,))}
    name = write(loras, "image_only.safetensors", sd)
    with pytest.raises(LycorisError, match="none of its 2 modules fit this model") as err:
        run_node(LycorisLoaderModelOnly, model=t2v.patcher, lycoris_name=name, strength_model=1.0)
    assert "Wan 2.1 I2V image cross-attention" in str(err.value)
    (_s, _t, coverage), _ui = run(LycorisInfo, lycoris_name=name, model=t2v.patcher)
    cov = json.loads(coverage)
    assert (cov["applied"], cov["total"], cov["problems"], len(cov["harmless"])) == (0, 2, [], 2)
    assert cov["line"] == f"{name}: 0/2 modules applied, 2 not in this model (harmless: {WAN_WHAT})"


# --- ComfyUI-named I2V modules (ai-toolkit, musubi-tuner) and LTX-2's audio branch, on meta-device models ------------

@pytest.fixture(scope="module")
def meta():
    # Wan 2.2 as ComfyUI's detection reads it: I2V A14B has no img_emb (model_type t2v, in_dim 36: WAN21_T2V), TI2V
    # 5B is WAN22_T2V (out_dim 48)
    configs = {"wan": (supported.WAN21_T2V, WAN_CONFIG), "wan_i2v": (supported.WAN21_I2V, WAN_I2V_CONFIG),
               "wan22_i2v_a14b": (supported.WAN21_T2V, {**WAN_CONFIG, "in_dim": 36}),
               "wan22_ti2v_5b": (supported.WAN22_T2V, {**WAN_CONFIG, "in_dim": 48, "out_dim": 48}),
               "ltxv": (supported.LTXV, LTXV_CONFIG)}
    if hasattr(supported, "LTXAV"):  # 0.3.75 has no LTX-2
        configs["ltx2"] = (supported.LTXAV, LTX2_CONFIG)
    return {arch: cls(dict(config)).get_model({}, "", device="meta") for arch, (cls, config) in configs.items()}


def meta_report(model, sd: dict):
    lfile = parse_state_dict(sd, "file.safetensors")
    return build_patches(lfile, lora_key_map(model, is_clip=False), {"model": model_shapes(model)}, False)[1]


def wan_i2v_names() -> dict:
    """ComfyUI-named I2V modules as trainers write them, plus one text cross-attention module that applies."""
    return {**_module("diffusion_model.blocks.0.cross_attn.k_img", PEFT, DIM, (DIM,)),  # AI_TOOLKIT_WAN
            **_module("diffusion_model.blocks.1.cross_attn.v_img", PEFT, DIM, (DIM,)),  # AI_TOOLKIT_WAN
            **_module("lora_unet_blocks_1_cross_attn_k_img", LORA, DIM, (DIM,)),  # MUSUBI
            **_module("lora_unet_img_emb_proj_1", LORA, 1280, (1280,)),  # MUSUBI (the image projection)
            **_module("lycoris_blocks_0_attn2_add_v_proj", LORA, DIM, (DIM,)),  # SIMPLETUNER (LyCORIS wrapper)
            # a norm's full change (LyCORIS / ComfyUI `.diff`) on the image key norm, in diffusers' name
            "transformer.blocks.0.attn2.norm_added_k.diff": torch.randn(DIM) * 0.01,
            # diffusers' fuse_projections concatenates add_k_proj and add_v_proj by rows (WanAttention)
            **_module("transformer.blocks.1.attn2.to_added_kv", PEFT, 2 * DIM, (DIM,)),
            **_module("lora_unet_blocks_0_cross_attn_k", LORA, DIM, (DIM,))}  # MUSUBI: text cross-attention


@pytest.mark.parametrize("arch", ["wan", "wan22_i2v_a14b", "wan22_ti2v_5b"])
def test_comfy_named_image_attention_is_harmless_on_t2v_and_applies_on_i2v(arch, meta):
    report = meta_report(meta[arch], wan_i2v_names())
    assert report.problems == [] and list(report.applied) == ["lora_unet_blocks_0_cross_attn_k.weight"]
    assert dict(report.harmless) == {
        "diffusion_model.blocks.0.cross_attn.k_img.weight": WAN_REASON,
        "diffusion_model.blocks.1.cross_attn.v_img.weight": WAN_REASON,
        "lora_unet_blocks_1_cross_attn_k_img.weight": WAN_REASON, "lora_unet_img_emb_proj_1.weight": WAN_REASON,
        "lycoris_blocks_0_attn2_add_v_proj.weight": WAN_REASON,
        "transformer.blocks.0.attn2.norm_added_k.weight": WAN_REASON,
        "transformer.blocks.1.attn2.to_added_kv.weight": WAN_REASON}
    assert report.line().endswith(f"1/8 modules applied (LoRA 1, {report_share(report)}% of parameters), "
                                  f"7 not in this model (harmless: {WAN_WHAT})")
    on_i2v = meta_report(meta["wan_i2v"], wan_i2v_names())
    assert on_i2v.problems == [] and on_i2v.harmless == [] and len(on_i2v.applied) == 8


def report_share(report) -> str:
    return f"{100 * report.params_applied / report.params_total:.0f}"


@pytest.mark.parametrize("name,suffixes,shape,why", [
    ("lora_unet_blocks_5_cross_attn_k_img", LORA, (DIM, DIM), "a block this model does not have"),
    ("diffusion_model.blocks.0.cross_attn.k_img", PEFT, (DIM, 5120), "another model's width"),
    ("lora_unet_blocks_0_cross_attn_k_imgs", LORA, (DIM, DIM), "a name no Wan model has"),
])
def test_broken_names_stay_failures(name, suffixes, shape, why, meta):
    report = meta_report(meta["wan"], _module(name, suffixes, shape[0], shape[1:]))
    assert report.harmless == [] and [(k, r.split(";")[0]) for k, r in report.problems] == [
        (f"{name}.weight", NO_SUCH_WEIGHT)], why
    assert "not in this model" not in report.line()


def test_image_attention_names_on_a_model_that_is_not_wan_are_failures(meta):
    """The evidence is the model's own weights (the block's text cross-attention), never the name alone."""
    report = meta_report(meta["ltxv"], _module("diffusion_model.blocks.0.cross_attn.k_img", PEFT, DIM, (DIM,)))
    assert report.harmless == [] and [r.split(";")[0] for _, r in report.problems] == [NO_SUCH_WEIGHT]


LTX_INNER = LTXV_CONFIG["num_attention_heads"] * LTXV_CONFIG["attention_head_dim"]
AUDIO_INNER = 2 * 64  # LTXAV's default audio heads x head dim (LTX2_CONFIG sets no audio widths)


def ltx2_file(shapes: dict[str, tuple[int, ...]]) -> dict:
    """LTX-2 modules as SimpleTuner writes them (SIMPLETUNER): audio ones in and outside the blocks, and one video
    module; each shaped for its LTXAV weight where the model has it."""
    def mod(name, suffixes, key, default):
        out, *inner = shapes.get(key, default)
        return _module(name, suffixes, out, tuple(inner))
    return {**mod("transformer.transformer_blocks.0.audio_attn1.to_q", PEFT,
                  "diffusion_model.transformer_blocks.0.audio_attn1.to_q.weight", (AUDIO_INNER, AUDIO_INNER)),
            **mod("lycoris_transformer_blocks_0_video_to_audio_attn_to_k", LORA,
                  "diffusion_model.transformer_blocks.0.video_to_audio_attn.to_k.weight", (AUDIO_INNER, LTX_INNER)),
            **mod("transformer.audio_proj_in", PEFT, "diffusion_model.audio_patchify_proj.weight", (AUDIO_INNER, 128)),
            **mod("transformer.transformer_blocks.0.attn1.to_q", PEFT,
                  "diffusion_model.transformer_blocks.0.attn1.to_q.weight", (LTX_INNER, LTX_INNER))}


def test_ltx2_audio_branch_is_harmless_on_video_only_ltx(meta):
    report = meta_report(meta["ltxv"], ltx2_file({}))
    assert report.problems == [] and list(report.applied) == ["transformer.transformer_blocks.0.attn1.to_q.weight"]
    assert dict(report.harmless) == dict.fromkeys(
        ["transformer.transformer_blocks.0.audio_attn1.to_q.weight",
         "lycoris_transformer_blocks_0_video_to_audio_attn_to_k.weight", "transformer.audio_proj_in.weight"],
        LTX_REASON)
    assert report.line().endswith(f"3 not in this model (harmless: {LTX_WHAT})")
    # an audio module of a block the model has not is no evidence: a failure
    other = meta_report(meta["ltxv"], _module("transformer.transformer_blocks.7.audio_attn1.to_q", PEFT, 8, (8,)))
    assert other.harmless == [] and len(other.problems) == 1


@pytest.mark.skipif(not hasattr(supported, "LTXAV"), reason="this ComfyUI has no LTX-2 (LTXAV)")
def test_ltx2_audio_branch_applies_on_ltx2(meta):
    report = meta_report(meta["ltx2"], ltx2_file(model_shapes(meta["ltx2"])))
    assert report.problems == [] and report.harmless == [] and len(report.applied) == 4


# --- text-encoder modules with no CLIP; the console ------------------------------------------------------------------

def test_text_encoder_modules_without_clip_are_harmless_at_info_level(sd15, loras, caplog):
    model, _clip = sd15
    name = write(loras, "mixed_te.safetensors", {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2)})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        (new_model,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0)
    assert list(new_model.patches) == [TO_Q_KEY]
    p = panel(ui)
    assert p["problems"] == [] and p["harmless"] == [[f"{TE_Q}.weight", NO_CLIP]]
    assert p["line"].endswith(f", 1 not in this model (harmless: {NOT_CONNECTED[NO_CLIP]})")
    ours = [r for r in caplog.records if r.name.startswith(LOGGER)]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert f"LyCORIS {p['line']}" in [r.getMessage() for r in ours if r.levelno == logging.INFO]


def test_a_failure_beside_harmless_misses_is_still_a_warning(sd15, loras, caplog):
    model, _clip = sd15
    broken = "lora_unet_no_such_block_attn1_to_q"
    name = write(loras, "mixed_broken.safetensors", {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2),
                                                     **lora(broken, 320, 320, seed=3)})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (_model,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0)
    p = panel(ui)
    assert [k for k, _ in p["problems"]] == [f"{broken}.weight"] and len(p["harmless"]) == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert warning.startswith(f"LyCORIS {p['line']}; not applied:") and broken in warning
    assert f"{TE_Q}.weight:" not in warning  # the harmless one is in the line's count, not the failures' list


# --- the panel -------------------------------------------------------------------------------------------------------

VIEW_TEST = Path(__file__).parent / "browser" / "coverage_view.test.mjs"


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js")
def test_panel_lists_harmless_misses_in_the_neutral_colour():
    result = subprocess.run(["node", "--test", str(VIEW_TEST)], check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
