"""The V3 loader nodes as ComfyUI runs them, on a tiny but real SD1.5 checkpoint loaded by ComfyUI's own loader.

Files are written by hand with kohya/LyCORIS key names; truth is W + ΔW computed in float64 here.
"""

import asyncio
import contextlib
import importlib.util
import logging

import comfy.model_management
import comfy.sd
import folder_paths
import lycoris_nodes
import pytest
import torch
from comfy_env import REPO_ROOT
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from node_runner import execute
from patcher_util import CPU, assert_rounded_from
from safetensors.torch import save_file

import nodes as comfy_nodes  # ComfyUI's nodes.py (setup_comfy put ComfyUI first on sys.path), not this repo's

ASSETS = REPO_ROOT / ".deps" / "test-assets"
TO_Q = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q"
TO_Q_KEY = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
PROJ_IN = "lora_unet_input_blocks_1_1_proj_in"
PROJ_IN_KEY = "diffusion_model.input_blocks.1.1.proj_in.weight"
TE_Q = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
TE_Q_KEY = "clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
LOGGER = "lycoris_nodes"


def _tiny_sd15_path():
    spec = importlib.util.spec_from_file_location("make_tiny_sd15", REPO_ROOT / "scripts" / "make_tiny_sd15.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_tiny_sd15(ASSETS / "tiny_sd15.safetensors")  # cached: rewritten only on a new version


@pytest.fixture(scope="module")
def sd15():
    model, clip, _vae, _ = comfy.sd.load_checkpoint_guess_config(str(_tiny_sd15_path()))
    assert type(model.model.model_config).__name__ == "SD15"
    yield model, clip
    comfy.model_management.unload_all_models()


@pytest.fixture(scope="module")
def originals(sd15):
    model, clip = sd15
    msd, csd = model.model.state_dict(), clip.cond_stage_model.state_dict()
    return {TO_Q_KEY: msd[TO_Q_KEY].clone(), PROJ_IN_KEY: msd[PROJ_IN_KEY].clone(), TE_Q_KEY: csd[TE_Q_KEY].clone()}


@contextlib.contextmanager
def listed_loras(folder):
    """`folder` as ComfyUI's (and so the node combo's) loras folder while in the block, the pack's cache empty."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(folder_paths.folder_names_and_paths, "loras", ([str(folder)], folder_paths.supported_pt_extensions))
        mp.setattr(folder_paths, "filename_list_cache", {})
        cache.clear()
        try:
            yield folder
        finally:
            cache.clear()


@pytest.fixture()
def loras(tmp_path):
    """An empty loras folder that ComfyUI's folder_paths (and so the node's combo) lists."""
    folder = tmp_path / "loras"
    folder.mkdir()
    with listed_loras(folder):
        yield folder
    comfy.model_management.unload_all_models()


def run_node(cls, **inputs):
    """Execute a node the way ComfyUI's executor does (VALIDATE_CLASS, class clone, EXECUTE_NORMALIZED)."""
    return execute(cls, **inputs).result


def rand(*shape, seed, s=0.05):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * s


def lora(prefix, out, inn, seed, rank=4, alpha=2.0, kernel=()):
    return {f"{prefix}.lora_up.weight": rand(out, rank, *[1] * len(kernel), seed=seed),
            f"{prefix}.lora_down.weight": rand(rank, inn, *kernel, seed=seed + 1),
            f"{prefix}.alpha": torch.tensor(alpha)}


def lora_delta64(sd, prefix):
    up, down = sd[f"{prefix}.lora_up.weight"].double(), sd[f"{prefix}.lora_down.weight"].double()
    return (up.flatten(1) @ down.flatten(1)) * float(sd[f"{prefix}.alpha"]) / down.shape[0]


def write(folder, name, sd, metadata=None):
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(folder / name), metadata=metadata)
    return name


def weights_after_full_load(patcher, keys, side="model"):
    """The weights ComfyUI would run with: full-load the patched clone, read, unpatch."""
    patcher.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        sd = (patcher.model.state_dict())
        return {k: sd[k].detach().clone() for k in keys}
    finally:
        patcher.unpatch_model(CPU)


def assert_untouched(model, clip, originals, uuid=None):
    comfy.model_management.unload_all_models()
    assert model.patches == {} and clip.patcher.patches == {}
    if uuid is not None:
        assert model.patches_uuid == uuid
    msd, csd = model.model.state_dict(), clip.cond_stage_model.state_dict()
    for key, value in originals.items():
        assert torch.equal((msd if key in msd else csd)[key], value), f"{key} changed"


def encode(clip):
    """(positive, negative) conditioning. CLIP-L on the CPU takes ~1-2 s per prompt, so tests reuse `conds`."""
    return comfy_nodes.CLIPTextEncode().encode(clip, "a photo of a cat")[0], \
        comfy_nodes.CLIPTextEncode().encode(clip, "")[0]


@pytest.fixture(scope="module")
def conds(sd15):
    return encode(sd15[1])


def sample(model, conds):
    positive, negative = conds
    latent = comfy_nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    out = comfy_nodes.common_ksampler(model, 0, 1, 1.0, "euler", "normal", positive, negative, latent)[0]["samples"]
    assert out.shape == (1, 4, 8, 8) and bool(torch.isfinite(out).all())
    return out


@pytest.fixture(scope="module")
def baseline(sd15, conds):
    """The unpatched model's sample, taken before any test patched anything."""
    return sample(sd15[0], conds)


# --- schema --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,node_id,names,outputs", [
    (LycorisLoader, "LycorisLoader",
     ["model", "clip", "lycoris_name", "strength_model", "strength_clip", "strength_mode", "apply_mode"],
     ["MODEL", "CLIP"]),
    (LycorisLoaderModelOnly, "LycorisLoaderModelOnly",
     ["model", "lycoris_name", "strength_model", "strength_mode", "apply_mode"], ["MODEL"]),
])
def test_schema(cls, node_id, names, outputs, loras):
    write(loras, "listed.safetensors", lora(TO_Q, 320, 320, seed=0))
    schema = cls.GET_SCHEMA()  # what ComfyUI does at registration: VALIDATE_CLASS, finalize, validate
    assert schema.node_id == node_id and node_id not in comfy_nodes.NODE_CLASS_MAPPINGS
    assert schema.category == "loaders/lycoris"
    assert schema.description and len(schema.description) > 40
    assert [i.id for i in schema.inputs] == names
    assert all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    assert all(o.tooltip for o in schema.outputs)

    info = cls.GET_NODE_INFO_V1()  # what /object_info serves
    order = info["input_order"]["required"] + info["input_order"].get("optional", [])
    assert order == names
    assert info["output"] == outputs and info["output_name"] == outputs
    assert info["category"] == "loaders/lycoris" and info["description"]
    inputs = {**info["input"]["required"], **info["input"].get("optional", {})}
    assert inputs["model"][0] == "MODEL" and (cls is LycorisLoaderModelOnly or inputs["clip"][0] == "CLIP")
    assert inputs["lycoris_name"][1]["options"] == ["listed.safetensors"]
    for name in names:
        if name.startswith("strength_") and name != "strength_mode":
            opts = inputs[name][1]
            assert inputs[name][0] == "FLOAT" and opts["default"] == 1.0 and opts["min"] <= -1 and opts["max"] >= 1
    assert inputs["strength_mode"][1]["options"] == ["linear", "lycoris"]
    assert inputs["strength_mode"][1]["default"] == "linear"
    assert all(t for t in info["output_tooltips"])


def test_extension_lists_every_node():
    extension = asyncio.run(lycoris_nodes.comfy_entrypoint())
    listed = asyncio.run(extension.get_node_list())
    assert {c.define_schema().node_id for c in listed} == {
        "LycorisLoader", "LycorisLoaderModelOnly", "LycorisRows", "LycorisExperts", "LycorisInfo", "LycorisBlockWeights",
        "LycorisBlockInfo",
        "LycorisStack", "LycorisApplyStack", "LycorisHook", "LycorisFade",
        "LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert"}


# --- applying ------------------------------------------------------------------------------------------------------

def test_applies_model_and_clip_parts(sd15, originals, loras, caplog):
    model, clip = sd15
    uuid = model.patches_uuid
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(PROJ_IN, 320, 320, seed=3, kernel=(1, 1)),
          **lora(TE_Q, 768, 768, seed=5)}
    name = write(loras, "style.safetensors", sd)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        new_model, new_clip = run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name,
                                       strength_model=0.8, strength_clip=-0.5, strength_mode="linear")
    assert new_model is not model and new_clip is not clip
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_untouched(model, clip, originals, uuid)

    got = weights_after_full_load(new_model, [TO_Q_KEY, PROJ_IN_KEY])
    assert_rounded_from(got[TO_Q_KEY], originals[TO_Q_KEY].double() + 0.8 * lora_delta64(sd, TO_Q), torch.float32)
    truth = originals[PROJ_IN_KEY].double() + 0.8 * lora_delta64(sd, PROJ_IN).reshape(320, 320, 1, 1)
    assert_rounded_from(got[PROJ_IN_KEY], truth, torch.float32)
    te = weights_after_full_load(new_clip.patcher, [TE_Q_KEY])[TE_Q_KEY]
    assert te.dtype == originals[TE_Q_KEY].dtype
    assert_rounded_from(te, originals[TE_Q_KEY].double() - 0.5 * lora_delta64(sd, TE_Q), te.dtype)
    assert_untouched(model, clip, originals, uuid)


def test_strength_zero_returns_the_inputs(sd15, loras):
    model, clip = sd15
    name = write(loras, "off.safetensors", lora(TO_Q, 320, 320, seed=1))
    out = LycorisLoader.execute(model=model, clip=clip, lycoris_name=name, strength_model=0.0, strength_clip=0.0)
    assert out.result[0] is model and out.result[1] is clip


# --- failures ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["flux-keys", "sd2-shapes"])
def test_file_for_another_architecture_is_one_clear_error(kind, sd15, originals, loras):
    model, clip = sd15
    uuid = model.patches_uuid
    if kind == "flux-keys":
        sd = {**lora("lora_unet_double_blocks_0_img_attn_qkv", 96, 32, seed=1),
              **lora("lora_unet_single_blocks_0_linear1", 64, 32, seed=2)}
        metadata = {"ss_base_model_version": "flux1"}
    else:  # SD2's cross attention reads a 1024-wide context; the names exist in SD1.5, the shapes do not
        sd = {**lora("lora_unet_input_blocks_1_1_transformer_blocks_0_attn2_to_k", 320, 1024, seed=1),
              **lora("lora_unet_input_blocks_1_1_transformer_blocks_0_attn2_to_v", 320, 1024, seed=2)}
        metadata = {"modelspec.architecture": "stable-diffusion-v2-768-v/lora"}
    name = write(loras, f"{kind}.safetensors", sd, metadata)
    with pytest.raises(LycorisError) as err:
        run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    message = str(err.value)
    assert name in message
    assert metadata.popitem()[1] in message  # says what the file declares it is for
    assert_untouched(model, clip, originals, uuid)


def test_unmatched_keys_are_applied_around_and_listed_once(sd15, originals, loras, caplog):
    model, _clip = sd15
    sd = {**lora(TO_Q, 320, 320, seed=1),
          **lora("lora_unet_no_such_block_attn1_to_q", 320, 320, seed=2),  # no such layer
          **lora("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k", 320, 64, seed=3),  # wrong shape
          "lora_unet_input_blocks_1_1_proj_out.some_unknown_suffix": torch.ones(3)}  # no algorithm reads it
    name = write(loras, "partly.safetensors", sd)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (new_model,) = run_node(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(LOGGER)]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert name in text
    for key in ("lora_unet_no_such_block_attn1_to_q", "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k",
                "lora_unet_input_blocks_1_1_proj_out.some_unknown_suffix"):
        assert key in text
    assert TO_Q not in text.replace("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k", "")
    assert list(new_model.patches) == [TO_Q_KEY]
    got = weights_after_full_load(new_model, [TO_Q_KEY])[TO_Q_KEY]
    assert_rounded_from(got, originals[TO_Q_KEY].double() + lora_delta64(sd, TO_Q), torch.float32)


def test_text_encoder_part_with_model_only_node(sd15, originals, loras, caplog):
    model, clip = sd15
    mixed = write(loras, "mixed.safetensors", {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2)})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        (new_model,) = run_node(LycorisLoaderModelOnly, model=model, lycoris_name=mixed, strength_model=1.0)
    ours = [r for r in caplog.records if r.name.startswith(LOGGER)]
    # missing by design, so no warning: the info line counts it as harmless (issue #34)
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert any("1 not in this model (harmless: text-encoder modules with no CLIP connected)" in r.getMessage()
               for r in ours if r.levelno == logging.INFO)
    assert list(new_model.patches) == [TO_Q_KEY]

    te_only = write(loras, "te_only.safetensors", lora(TE_Q, 768, 768, seed=2))
    with pytest.raises(LycorisError, match="no CLIP is connected") as err:
        run_node(LycorisLoaderModelOnly, model=model, lycoris_name=te_only, strength_model=1.0)
    assert te_only in str(err.value)
    assert_untouched(model, clip, originals)


def _corrupt(folder, kind):
    good = lora(TO_Q, 320, 320, seed=1)
    name = f"{kind}.safetensors"
    path = folder / name
    if kind == "nan":
        good[f"{TO_Q}.lora_down.weight"][1, 7] = float("nan")
        write(folder, name, good)
    elif kind == "inf-alpha":
        good[f"{TO_Q}.alpha"] = torch.tensor(float("inf"))
        write(folder, name, good)
    elif kind == "truncated":
        write(folder, name, good)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
    elif kind == "garbage":
        path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                       dtype=torch.uint8).numpy().tobytes())
    elif kind == "bad-header":
        header = b'{"a": {"dtype": "F32", "shape": [2,'
        path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    elif kind == "empty":
        path.write_bytes(b"")
    return name


@pytest.mark.parametrize("kind", ["nan", "inf-alpha", "truncated", "garbage", "bad-header", "empty"])
def test_damaged_file_is_an_error_naming_it_and_the_model_still_works(kind, sd15, originals, loras, conds, baseline):
    model, clip = sd15
    uuid = model.patches_uuid
    name = _corrupt(loras, kind)
    with pytest.raises(LycorisError) as err:
        run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    assert name in str(err.value)
    assert_untouched(model, clip, originals, uuid)
    if kind == "nan":  # the inputs still work: the text encoder encodes and the model samples as before
        again = comfy_nodes.CLIPTextEncode().encode(clip, "a photo of a cat")[0]
        assert torch.equal(again[0][0], conds[0][0][0])
    assert torch.equal(sample(model, conds), baseline)
    assert_untouched(model, clip, originals, uuid)


def test_patched_model_samples_and_differs(sd15, originals, loras, conds, baseline):
    model, clip = sd15
    name = write(loras, "strong.safetensors", {**lora(TO_Q, 320, 320, seed=1, alpha=4.0, rank=4)})
    (patched,) = run_node(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=3.0)
    changed = sample(patched, conds)
    assert not torch.equal(baseline, changed)
    assert torch.equal(sample(model, conds), baseline)  # the input model is still the unpatched one
    assert_untouched(model, clip, originals)


def test_unet_only_file_with_model_strength_zero_is_not_an_error(sd15, originals, loras):
    """A/B switch: strength_model 0, strength_clip left at 1, on an ordinary UNet-only file (raised 'fits nothing'
    until 9ba2d3e: the model was not passed to the mapping when its strength was 0)."""
    model, clip = sd15
    name = write(loras, "unet_only.safetensors", lora(TO_Q, 320, 320, seed=1))
    comfy_nodes.LoraLoader().load_lora(model, clip, name, 0.0, 1.0)  # the core node accepts it (no error)
    new_model, new_clip = run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name,
                                   strength_model=0.0, strength_clip=1.0)
    assert new_model.patches == {} and new_clip.patcher.patches == {}
    assert_untouched(model, clip, originals)
