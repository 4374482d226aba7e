"""Bypass mode (apply_mode "bypass" / "auto") through the nodes and ComfyUI's own loading, sampling and offload, on
the tiny real SD1.5 checkpoint (also loaded with fp8 weights), and a hand-built model with ComfyUI's quantized and
scaled-fp8 layers.

Truth is never the bypass code itself:
* the same file merged (apply_mode "merge": ComfyUI's weight patching, which test_nodes / test_comfy_patching check
  against float64 formulas and the LyCORIS reference), on the same model or on a float32 copy of an fp8 model;
* the unpatched model, to show every comparison can fail (each file changes the output far more than the tolerance);
* ComfyUI's own counters of its work: calls of ModelPatcher.patch_weight_to_device and LowVramPatch creations.

Tolerance for "bypass equals merge" in fp32: bypass computes f(x; W) + F₀(x; D) where merge computes f(x; W + D)
with W + D rounded once to fp32; both are exact up to float32 reassociation (a few ulps, ~1e-7 relative, per layer).
Through the patched and downstream layers and one sampler step this measured 5e-7 of the sample's norm for every
file here, so RTOL = 1e-5 is a 20x margin; every file changes the sample by 5e-2 to 4e-1 of its norm (required:
> 1e-2), so an adapter missing, doubled, at the wrong strength or on the wrong layer cannot pass.
"""

import contextlib
import json

import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.sd
import comfy.utils
import pytest
import test_nodes
import torch
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.lycoris_core.bypass import Contribution, LayerOp, layer_output
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.glue.apply import patched_clone
from lycoris_nodes.nodes.glue.bypass import BypassLayer
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.scheduling.stack import LycorisApplyStack, LycorisStack
from node_runner import execute as run_node
from patcher_util import (
    CPU,
    fp8_storage,
    full_load,
    lowvram_patched,
    lycoris_patches,
    offload,
    patcher,
    quantized_linear,
    scaled_fp8_linear,
    set_param,
)
from test_nodes import PROJ_IN, TE_Q, TE_Q_KEY, TO_Q, lora, write
from test_regressions import KEY_MAP, Net, hand_variants, inputs, layer_of
from torch._subclasses.fake_tensor import FakeTensorMode

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras

RTOL = 1e-5  # see the module docstring
MIN_CHANGE = 1e-2  # every file changes the sample by more than this (relative), 1000x RTOL
ATTRIBUTE = "_lycoris_bypass"

CONV3 = "lora_unet_input_blocks_1_0_in_layers_2"  # Conv2d 320→320, 3×3
MID_CONV = "lora_unet_middle_block_0_in_layers_2"  # Conv2d 320→320, 3×3
MID_FF = "lora_unet_middle_block_1_transformer_blocks_0_ff_net_2"  # Linear 1280→320
OUT_V = "lora_unet_output_blocks_1_1_transformer_blocks_0_attn2_to_v"  # Linear 768→320
OUT_SKIP = "lora_unet_output_blocks_0_0_skip_connection"  # Conv2d 640→320, 1×1
PROJ_OUT = "lora_unet_output_blocks_1_1_proj_out"  # Conv2d 320→320, 1×1, with a bias


# the model weight each prefix patches (ldm names have underscores of their own, so they are written out)
UKEYS = {
    TO_Q: "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
    CONV3: "diffusion_model.input_blocks.1.0.in_layers.2.weight",
    PROJ_IN: "diffusion_model.input_blocks.1.1.proj_in.weight",
    MID_CONV: "diffusion_model.middle_block.0.in_layers.2.weight",
    MID_FF: "diffusion_model.middle_block.1.transformer_blocks.0.ff.net.2.weight",
    OUT_V: "diffusion_model.output_blocks.1.1.transformer_blocks.0.attn2.to_v.weight",
    OUT_SKIP: "diffusion_model.output_blocks.0.0.skip_connection.weight",
    PROJ_OUT: "diffusion_model.output_blocks.1.1.proj_out.weight",
}


@pytest.fixture(autouse=True)
def no_panel_measurement(monkeypatch):
    """The loaders measure per-block change for the panel (one more patch pass); nothing here reads it."""
    monkeypatch.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)


# --- helpers ---------------------------------------------------------------------------------------------------------

def execute(cls, uid: str | None = None, **inputs):
    """A node executed the way ComfyUI's executor does (in inference mode, combo values checked), with the hidden
    UNIQUE_ID of node `uid` (the class clone gets `hidden` through PREPARE_CLASS_CLONE); returns the NodeOutput
    (.result, .ui)."""
    return run_node(cls, uid, inference=True, **inputs)  # in inference mode, as ComfyUI's executor runs a prompt


def loader(model, clip, name, strength_model=1.0, strength_clip=1.0, mode="bypass", uid=None, **extra):
    cls = LycorisLoader if clip is not None else LycorisLoaderModelOnly
    kwargs = {"clip": clip, "strength_clip": strength_clip} if clip is not None else {}
    out = execute(cls, uid, model=model, lycoris_name=name, strength_model=strength_model, apply_mode=mode,
                  **kwargs, **extra)
    return out.result if clip is not None else (out.result[0], None)


@pytest.fixture(scope="module")
def conds():
    """Fixed random conditioning (CLIP-L on the CPU costs ~1.5 s a prompt; only the text-encoder test encodes)."""
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(1, 77, 768, generator=gen) * 0.5, {}]], [[torch.zeros(1, 77, 768), {}]]


def sample(model, conds, steps: int = 1):
    """Euler steps (one by default) through ComfyUI's KSampler (which loads the model with load_models_gpu), in
    inference mode as ComfyUI runs it (merging into fp8 needs it: ComfyUI's stochastic rounding writes with out=)."""
    latent = comfy_nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    with torch.inference_mode():
        out = comfy_nodes.common_ksampler(model, 0, steps, 1.0, "euler", "normal", *conds, latent)[0]["samples"]
    assert bool(torch.isfinite(out).all())
    return out


@pytest.fixture(scope="module")
def baseline(sd15, conds):
    return sample(sd15[0], conds)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_matches(got, truth, base, what, rtol=RTOL, min_change=MIN_CHANGE):
    """`got` equals `truth` within rtol (of its norm), and `truth` is clearly not `base` (the test can fail)."""
    change = rel(truth, base)
    assert change > min_change, f"{what}: the file barely changes the output ({change:.2e}); the test proves nothing"
    err = rel(got, truth)
    assert err <= rtol, f"{what}: {err:.2e} from the truth (tolerance {rtol:.0e}; the change itself is {change:.2e})"


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.contiguous().flatten().view(torch.uint8) if t.is_floating_point() else t.flatten()


def changed_keys(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> set[str]:
    now = module.state_dict()
    assert set(now) == set(saved)
    return {k for k, v in saved.items()
            if now[k].dtype != v.dtype or now[k].shape != v.shape or not torch.equal(bits(now[k]), bits(v))}


def bypassed_layers(module: torch.nn.Module) -> dict[str, BypassLayer]:
    return {n: m.__dict__[ATTRIBUTE] for n, m in module.named_modules() if ATTRIBUTE in m.__dict__}


def assert_no_bypass_left(*modules: torch.nn.Module) -> None:
    for module in modules:
        left = [n for n, m in module.named_modules() if ATTRIBUTE in m.__dict__ or "forward" in m.__dict__]
        assert not left, f"{len(left)} layers keep a bypass forward, e.g. {left[:3]}"


def rand(*shape, seed, s=0.05):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * s


def conv_lora(prefix, out, inn, seed, rank=4, alpha=2.0, tucker=False):
    if not tucker:
        return lora(prefix, out, inn, seed, rank, alpha, kernel=(3, 3))
    return {f"{prefix}.lora_up.weight": rand(out, rank, 1, 1, seed=seed),
            f"{prefix}.lora_down.weight": rand(rank, inn, 1, 1, seed=seed + 1),
            f"{prefix}.lora_mid.weight": rand(rank, rank, 3, 3, seed=seed + 2, s=0.3),
            f"{prefix}.alpha": torch.tensor(alpha)}


def loha(prefix, out, flat_in, seed, rank=4):
    return {f"{prefix}.hada_w1_a": rand(out, rank, seed=seed, s=0.2),
            f"{prefix}.hada_w1_b": rand(rank, flat_in, seed=seed + 1, s=0.2),
            f"{prefix}.hada_w2_a": rand(out, rank, seed=seed + 2, s=0.2),
            f"{prefix}.hada_w2_b": rand(rank, flat_in, seed=seed + 3, s=0.2),
            f"{prefix}.alpha": torch.tensor(2.0)}


def row_norms(w: torch.Tensor) -> torch.Tensor:
    return w.float().flatten(1).norm(dim=1)


def lokr_dora(prefix, weight, w1, w2, seed, rank=None):
    """LoKr (w1 ⊗ w2, w2 full or as w2_a @ w2_b) with output-axis DoRA, magnitude ≈ ‖W‖ per row (±5 %)."""
    out = weight.shape[0]
    sd = {f"{prefix}.lokr_w1": rand(*w1, seed=seed, s=0.3)}
    if rank is None:
        sd[f"{prefix}.lokr_w2"] = rand(*w2, seed=seed + 1, s=0.02)
    else:
        sd[f"{prefix}.lokr_w2_a"] = rand(w2[0], rank, seed=seed + 1, s=0.1)
        sd[f"{prefix}.lokr_w2_b"] = rand(rank, w2[1], seed=seed + 2, s=0.1)
        sd[f"{prefix}.alpha"] = torch.tensor(float(rank))
    scale = row_norms(weight) * (1 + rand(out, seed=seed + 3, s=1.0) * 0.05)
    sd[f"{prefix}.dora_scale"] = scale.reshape(out, *[1] * (weight.ndim - 1))
    return sd


def oft(prefix, out, seed, block=8, constraint=0.0):
    return {f"{prefix}.oft_blocks": rand(out // block, block, block, seed=seed, s=0.1),
            f"{prefix}.alpha": torch.tensor(constraint),
            f"{prefix}.rescale": 1 + rand(out, 1, seed=seed + 1, s=0.05)}


def te_lora(seed):
    return lora(TE_Q, 768, 768, seed=seed, alpha=4.0)


def file_kinds(msd) -> dict[str, dict[str, torch.Tensor]]:
    """Hand-written files on real module names of the tiny SD1.5 (kohya/LyCORIS key layouts)."""
    return {
        # LoCon: Linear, 3×3 conv, 1×1 conv (640 in), Tucker conv, and a text-encoder module
        "locon": {**lora(TO_Q, 320, 320, seed=1, alpha=4.0), **conv_lora(CONV3, 320, 320, seed=3),
                  **lora(OUT_SKIP, 320, 640, seed=5, kernel=(1, 1)),
                  **conv_lora(MID_CONV, 320, 320, seed=7, tucker=True), **te_lora(9)},
        # LoHa on Linear and 3×3 conv, plus a full diff with a bias diff (a float bias is merged in every mode)
        "loha": {**loha(TO_Q, 320, 320, seed=11), **loha(CONV3, 320, 320 * 9, seed=15),
                 **loha(OUT_V, 320, 768, seed=19),
                 f"{PROJ_OUT}.diff": rand(320, 320, 1, 1, seed=23, s=0.01),
                 f"{PROJ_OUT}.diff_b": rand(320, seed=24, s=0.05)},
        # LoKr (factored and full w2, Linear and 3×3 conv) with output-axis DoRA: reads W
        "lokr_dora": {**lokr_dora(TO_Q, msd[UKEYS[TO_Q]], (8, 8), (40, 40), seed=31, rank=4),
                      **lokr_dora(CONV3, msd[UKEYS[CONV3]], (8, 8), (40, 40, 3, 3), seed=35),
                      **lokr_dora(MID_FF, msd[UKEYS[MID_FF]], (4, 8), (80, 160), seed=39, rank=8)},
        # Diag-OFT with rescale: rotates W's rows, reads W
        "oft": {**oft(TO_Q, 320, seed=41), **oft(CONV3, 320, seed=43, block=40, constraint=1e-3),
                **oft(OUT_SKIP, 320, seed=45)},
    }


@pytest.fixture(scope="module")
def kinds(sd15):
    return file_kinds(sd15[0].model.state_dict())


@pytest.fixture(scope="module")
def saved(sd15):
    """The UNet's and CLIP's state dicts before any test patched anything."""
    model, clip = sd15
    return snapshot(model.model), snapshot(clip.cond_stage_model)


# --- 1. bypass equals merge, weights untouched -----------------------------------------------------------------------

@pytest.mark.parametrize("kind,strength,strength_mode", [
    ("locon", 0.8, "linear"), ("loha", 1.5, "linear"), ("lokr_dora", 0.7, "lycoris"), ("oft", 1.25, "linear"),
])
def test_bypass_sample_equals_merge_and_weights_stay(kind, strength, strength_mode, sd15, kinds, saved, loras, conds,
                                                     baseline):
    model, _clip = sd15
    sd = {k: v for k, v in kinds[kind].items() if not k.startswith("lora_te")}
    name = write(loras, f"{kind}.safetensors", sd)
    modules = {k.split(".")[0] for k in sd}
    biases = {UKEYS[p].removesuffix("weight") + "bias" for p in modules if f"{p}.diff_b" in sd}

    merged, _ = loader(model, None, name, strength, mode="merge", strength_mode=strength_mode)
    truth = sample(merged, conds)
    out = execute(LycorisLoaderModelOnly, "11", model=model, lycoris_name=name, strength_model=strength,
                  strength_mode=strength_mode, apply_mode="bypass")
    (bypassed,) = out.result
    assert out.ui["lycoris"][0]["bypassed"] == len(modules)
    assert set(bypassed.patches) == biases  # only bias changes are merged
    assert set(bypassed.injections) == {"lycoris:11"}

    got = sample(bypassed, conds)
    assert_matches(got, truth, baseline, f"{kind} bypass vs merge")

    # while the bypass clone is loaded: its layers run the adapters, and no weight but a merged bias has changed
    layers = bypassed_layers(model.model)
    assert {f"{n}.weight" for n in layers} == {UKEYS[p] for p in modules}
    assert all(len(b.entries) == 1 for b in layers.values())
    assert changed_keys(model.model, saved[0]) == biases

    comfy.model_management.unload_all_models()
    assert_no_bypass_left(model.model)
    assert changed_keys(model.model, saved[0]) == set()


def encode(clip, tokens):
    with torch.inference_mode():
        return clip.encode_from_tokens(tokens)


def test_text_encoder_bypass_equals_merge(sd15, kinds, saved, loras):
    """The CLIP side: bypass runs the text-encoder module in its (fp16, manual_cast) layer's forward; the encoded
    conditioning equals merged (within fp16 rounding of the merged weight, see below), the CLIP weights stay."""
    model, clip = sd15
    name = write(loras, "locon.safetensors", kinds["locon"])
    tokens = clip.tokenize("a photo of a cat")
    base = encode(clip, tokens)
    _m, merged_clip = loader(model, clip, name, 1.0, 1.5, mode="merge")
    truth = encode(merged_clip, tokens)
    _m, bypass_clip = loader(model, clip, name, 1.0, 1.5, mode="bypass", uid="12")
    assert bypass_clip.patcher.patches == {} and set(bypass_clip.patcher.injections) == {"lycoris:12"}
    got = encode(bypass_clip, tokens)
    # Merge stores W + D rounded to fp16 (the CLIP's weight dtype, relative error <= 2^-11 per element); bypass keeps
    # W and adds D in the fp32 compute dtype. Measured 7e-5 apart for a change of 8e-2: 1e-3 allows 15x that (2x
    # the per-element worst case) and is still < 1/10 of any change this test accepts.
    assert_matches(got, truth, base, "text encoder bypass vs merge", rtol=1e-3, min_change=1e-2)
    assert set(bypassed_layers(clip.cond_stage_model)) == {TE_Q_KEY.removesuffix(".weight")}
    assert changed_keys(clip.cond_stage_model, saved[1]) == set()
    comfy.model_management.unload_all_models()
    assert_no_bypass_left(model.model, clip.cond_stage_model)
    assert changed_keys(clip.cond_stage_model, saved[1]) == set()


def unet_only(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if not k.startswith("lora_te")}


# --- 2. stacking -----------------------------------------------------------------------------------------------------

def test_stacked_bypass_nodes_equal_stacked_merges(sd15, kinds, loras, conds, baseline):
    """Two loader nodes (ids 21, 22) in bypass = the two merged in the same order; OFT reads W, so it must see the
    LoCon's change first (same layers: to_q, the 3×3 conv, the skip connection). LyCORIS Apply Stack (id 31) in
    bypass = the same chain. Two nodes with the SAME id: the second replaces the first's entries — what a node
    re-run needs (its new entries replace its old ones); ids differ between nodes, so nodes never collide."""
    model, _clip = sd15
    a = write(loras, "a_locon.safetensors", unet_only(kinds["locon"]))
    b = write(loras, "b_oft.safetensors", kinds["oft"])
    m1, _ = loader(model, None, a, 0.8, mode="merge")
    m2, _ = loader(m1, None, b, 1.25, mode="merge")
    truth = sample(m2, conds)

    b1, _ = loader(model, None, a, 0.8, uid="21")
    first_alone = sample(b1, conds)  # b1 is loaded (injected) when b2 is cloned from it: b2 copies that flag
    b2, _ = loader(b1, None, b, 1.25, uid="22")
    assert set(b2.injections) == {"lycoris:21", "lycoris:22"} and b2.patches == {}
    chained = sample(b2, conds)
    assert_matches(chained, truth, baseline, "two bypass loaders vs two merged")
    to_q = bypassed_layers(model.model)[UKEYS[TO_Q].removesuffix(".weight")]
    assert [key for key, _i in to_q.entries] == ["lycoris:21", "lycoris:22"]  # graph order

    (stack,) = execute(LycorisStack, stack=f"{a} | 0.8\n{b} | 1.25").result
    out = execute(LycorisApplyStack, "31", model=model, lora_stack=stack, apply_mode="bypass")
    stacked = out.result[0]
    assert set(stacked.injections) == {"lycoris:31:0", "lycoris:31:1"} and stacked.patches == {}
    assert [line.endswith(" in bypass)") for line in out.ui["text"]] == [True, True]
    assert torch.equal(sample(stacked, conds), chained)  # same entries, same order: the same computation
    (merged_stack, _c) = execute(LycorisApplyStack, model=model, lora_stack=stack, apply_mode="merge").result
    assert torch.equal(sample(merged_stack, conds), truth)  # ... and the merged stack is the merged chain

    s1, _ = loader(model, None, a, 0.8, uid="23")
    s2, _ = loader(s1, None, b, 1.25, uid="23")
    assert set(s2.injections) == {"lycoris:23"}
    alone, _ = loader(model, None, b, 1.25, uid="24")
    replaced = sample(s2, conds)
    assert torch.equal(replaced, sample(alone, conds))
    assert rel(replaced, chained) > MIN_CHANGE  # so the first file's entries are really gone
    assert torch.equal(sample(b1, conds), first_alone)  # and the first node's output still runs it alone
    comfy.model_management.unload_all_models()
    assert_no_bypass_left(model.model)


def test_block_weights_in_bypass_equal_merge(sd15, kinds, loras, conds, baseline):
    model, clip = sd15
    name = write(loras, "bw_locon.safetensors", unet_only(kinds["locon"]))  # input, middle and output blocks
    bw = "default=1; input_blocks.*=0; output_blocks.*=0.5"
    common = {"model": model, "clip": clip, "lycoris_name": name, "strength_model": 1.5, "strength_clip": 0.0,
              "block_weights": bw, "preset": "custom"}
    merged = execute(LycorisBlockWeights, apply_mode="merge", **common).result[0]
    assert set(merged.patches) == {UKEYS[MID_CONV], UKEYS[OUT_SKIP]}  # input blocks weighted 0: left out
    out = execute(LycorisBlockWeights, "41", apply_mode="bypass", **common)
    bypassed = out.result[0]
    assert bypassed.patches == {} and out.ui["lycoris"][0]["bypassed"] == 2
    got = sample(bypassed, conds)
    strengths = {f"{n}.weight": [c.strength for c in b.entries.values()]
                 for n, b in bypassed_layers(model.model).items()}
    assert strengths == {UKEYS[MID_CONV]: [1.5], UKEYS[OUT_SKIP]: [0.75]}
    assert_matches(got, sample(merged, conds), baseline, "block weights, bypass vs merge")


# --- 3. a strength change re-patches no weight in bypass ------------------------------------------------------------

@pytest.fixture()
def counters(monkeypatch):
    """How often ComfyUI patches a weight (patch_weight_to_device on a key that has patches) and creates a
    LowVramPatch (the offloaded path's per-forward patch)."""
    counts = {"patch": 0, "lowvram": 0}
    patch = comfy.model_patcher.ModelPatcher.patch_weight_to_device
    lowvram_init = comfy.model_patcher.LowVramPatch.__init__

    def counting_patch(self, key, *args, **kwargs):
        counts["patch"] += key in self.patches
        return patch(self, key, *args, **kwargs)

    def counting_lowvram(self, *args, **kwargs):
        counts["lowvram"] += 1
        lowvram_init(self, *args, **kwargs)

    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "patch_weight_to_device", counting_patch)
    monkeypatch.setattr(comfy.model_patcher.LowVramPatch, "__init__", counting_lowvram)
    return counts


def denoise_loaded(clone, load, conds, check=None):
    """Load `clone` with `load` (full_load/offload) in inference mode, as ComfyUI does (the cached file's tensors are
    inference tensors), run `check(clone)` if given, take one UNet evaluation, and unpatch again."""
    with torch.inference_mode():
        load(clone)
    try:
        if check is not None:
            check(clone)
        return denoise(clone, conds)
    finally:
        clone.unpatch_model(CPU)


def denoise(model_patcher, conds):
    """One UNet evaluation on the patcher's model as it is loaded now (no load_models_gpu, so offload stays)."""
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5)) * 3
    with torch.inference_mode():
        return model_patcher.model.apply_model(x, torch.tensor([2.5]), c_crossattn=conds[0][0][0])


@pytest.mark.parametrize("path", ["full", "offloaded"])
def test_strength_change_repatches_nothing_in_bypass(path, sd15, kinds, loras, conds, counters):
    """The same node (id 51) re-run at another strength, then loaded as ComfyUI loads it: fully (load_models_gpu,
    then sampled), or offloaded (what load_models_gpu does in low VRAM: detach the loaded clone, then
    partially_load the new one, here with 1 byte so every layer stays offloaded; then one UNet evaluation)."""
    model, _clip = sd15
    sd = unet_only(kinds["locon"])
    name = write(loras, "strength.safetensors", sd)
    n_keys = len({k.split(".")[0] for k in sd})
    outputs, work = {}, {}
    for mode in ("bypass", "merge"):
        comfy.model_management.unload_all_models()
        previous = None
        for strength in (1.0, 2.0):
            new, _ = loader(model, None, name, strength, mode=mode, uid="51")
            assert len(new.patches) == (n_keys if mode == "merge" else 0)
            counters.update(patch=0, lowvram=0)
            if path == "full":
                with torch.inference_mode():
                    comfy.model_management.load_models_gpu([new])
                work[mode, strength] = dict(counters)
                outputs[mode, strength] = sample(new, conds)
            else:
                with torch.inference_mode():
                    if previous is not None:
                        previous.detach(unpatch_all=False)
                    new.partially_load(CPU, extra_memory=1)
                work[mode, strength] = dict(counters)
                assert new.model.model_lowvram
                to_q = new.model.get_submodule(UKEYS[TO_Q].removesuffix(".weight"))
                assert to_q.comfy_cast_weights and lowvram_patched(to_q) == (mode == "merge")
                assert (ATTRIBUTE in to_q.__dict__) == (mode == "bypass")
                outputs[mode, strength] = denoise(new, conds)
            if mode == "bypass":  # the old clone's entries left with it: one entry per layer, at this strength
                assert [c.strength for b in bypassed_layers(model.model).values() for c in b.entries.values()] \
                    == [strength] * n_keys
            previous = new
        if path == "offloaded":
            previous.unpatch_model(CPU)
    comfy.model_management.unload_all_models()
    assert_no_bypass_left(model.model)

    print(f"\nweight work on the strength change ({path}): bypass {work['bypass', 2.0]}, merge {work['merge', 2.0]}")
    assert work["bypass", 1.0] == work["bypass", 2.0] == {"patch": 0, "lowvram": 0}
    redo = {"patch": n_keys, "lowvram": 0} if path == "full" else {"patch": 0, "lowvram": n_keys}
    assert work["merge", 1.0] == work["merge", 2.0] == redo  # merge re-patches every touched weight
    # the new strength takes effect, and equals a merge at that strength
    assert_matches(outputs["bypass", 2.0], outputs["merge", 2.0], outputs["merge", 1.0], f"{path}, strength 2")
    assert_matches(outputs["bypass", 1.0], outputs["merge", 1.0], outputs["merge", 2.0], f"{path}, strength 1")


# --- 4. auto on fp8 and quantized weights ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_models():
    """The tiny SD1.5 UNet loaded by ComfyUI with fp8 e4m3 weights (manual_cast layers, fp32 compute on the CPU),
    and a float32 copy holding exactly the same (fp8) values."""
    path = str(test_nodes._tiny_sd15_path())
    fp8 = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False,
                                                model_options={"dtype": torch.float8_e4m3fn})[0]
    f32 = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False)[0]
    fp8_sd = fp8.model.diffusion_model.state_dict()
    assert {v.dtype for v in fp8_sd.values()} == {torch.float8_e4m3fn}
    f32.model.diffusion_model.load_state_dict({k: v.to(torch.float32) for k, v in fp8_sd.items()})
    yield fp8, f32
    comfy.model_management.unload_all_models()


def fp8_file(kinds):
    """LoCon (1×1 and Tucker conv) and LoKr+DoRA (Linear, 3×3 conv; DoRA reads the fp8 weight as float)."""
    locon = {k: v for k, v in kinds["locon"].items() if k.split(".")[0] in (OUT_SKIP, MID_CONV)}
    return {**locon, **kinds["lokr_dora"]}


def test_auto_bypasses_fp8_layers_and_equals_merge_into_a_float_copy(fp8_models, kinds, loras, conds):
    fp8, f32 = fp8_models
    sd = fp8_file(kinds)
    name = write(loras, "fp8.safetensors", sd)
    n = len({k.split(".")[0] for k in sd})
    saved = snapshot(fp8.model)
    base = sample(fp8, conds)
    assert_matches(sample(f32, conds), base, base, "the float copy is the same model", rtol=1e-6, min_change=-1)

    out = execute(LycorisLoaderModelOnly, "61", model=fp8, lycoris_name=name, strength_model=1.25, apply_mode="auto")
    (auto,) = out.result
    assert out.ui["lycoris"][0]["bypassed"] == n and auto.patches == {}
    got = sample(auto, conds)
    assert len(bypassed_layers(fp8.model)) == n
    assert changed_keys(fp8.model, saved) == set()  # while loaded: the fp8 weights are bit-identical

    merged_f32, _ = loader(f32, None, name, 1.25, mode="merge")
    truth = sample(merged_f32, conds)
    assert_matches(got, truth, base, "auto on fp8 vs merge into float")
    merged_fp8, _ = loader(fp8, None, name, 1.25, mode="merge")  # what auto avoids: rounding W + D to fp8
    assert rel(sample(merged_fp8, conds), truth) > 100 * rel(got, truth)

    comfy.model_management.unload_all_models()
    assert_no_bypass_left(fp8.model)
    assert changed_keys(fp8.model, saved) == set()
    # on a float model, auto merges everything
    out = execute(LycorisLoaderModelOnly, model=f32, lycoris_name=name, strength_model=1.25, apply_mode="auto")
    assert out.ui["lycoris"][0]["bypassed"] == 0 and len(out.result[0].patches) == n and not out.result[0].injections


# PEFT's names (save_pretrained) of output_blocks.1.1's proj_out (1×1 conv) and attn1.to_out.0 (Linear)
PEFT_PROJ_OUT = "base_model.model.up_blocks.0.attentions.1.proj_out"
PEFT_TO_OUT = "base_model.model.up_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0"
TO_OUT_KEY = "diffusion_model.output_blocks.1.1.transformer_blocks.0.attn1.to_out.0.weight"


def fp8_bias_file(kind: str) -> dict[str, torch.Tensor]:
    """Bias changes on a 1×1 conv and a Linear that have biases: full diffs with bias diffs, or PEFT's (IA)³ (its
    merge scales the bias too, b' = l·b)."""
    if kind == "full":
        return {f"{PROJ_OUT}.diff": rand(320, 320, 1, 1, seed=61, s=0.01), f"{PROJ_OUT}.diff_b": rand(320, seed=62),
                f"{MID_FF}.diff": rand(320, 1280, seed=63, s=0.005), f"{MID_FF}.diff_b": rand(320, seed=64)}
    return {f"{PEFT_PROJ_OUT}.ia3_l": 1 + rand(1, 320, 1, 1, seed=65, s=0.3),
            f"{PEFT_TO_OUT}.ia3_l": 1 + rand(320, 1, seed=66, s=0.3)}


@pytest.mark.parametrize("kind", ["full", "peft-ia3"])
@pytest.mark.parametrize("mode", ["bypass", "auto"])
def test_bias_changes_on_fp8_are_added_at_run_time_in_bypass_and_auto(mode, kind, fp8_models, loras, conds):
    """A merge rounds b + Δb into the fp8 bias; bypass and auto add Δb at run time as they add the weight change, so
    the fp8 model computes what the same file merged into its float32 copy computes, and its biases stay as stored."""
    fp8, f32 = fp8_models
    name = write(loras, f"fp8_bias_{kind}.safetensors", fp8_bias_file(kind))
    with random_biases(fp8, f32, [UKEYS[PROJ_OUT], UKEYS[MID_FF], TO_OUT_KEY]):
        check_fp8_bias_file(mode, name, fp8, f32, conds)


@contextlib.contextmanager
def random_biases(fp8, f32, weight_keys: list[str]):
    """Non-zero biases for these layers (the tiny checkpoint's are zero, which (IA)³'s l·b would leave as they
    are), the same fp8 values in both models, written in place (unloaded); the stored ones are put back after."""
    comfy.model_management.unload_all_models()
    params = [(comfy.utils.get_attr(fp8.model, k), comfy.utils.get_attr(f32.model, k))
              for k in (key.removesuffix("weight") + "bias" for key in weight_keys)]
    before = [(a.detach().clone(), b.detach().clone()) for a, b in params]
    try:
        for i, (in_fp8, in_f32) in enumerate(params):
            value = rand(in_fp8.shape[0], seed=70 + i, s=0.5).to(torch.float8_e4m3fn)
            in_fp8.data.copy_(value)
            in_f32.data.copy_(value.to(torch.float32))
        yield
    finally:
        comfy.model_management.unload_all_models()
        for (in_fp8, in_f32), (old_fp8, old_f32) in zip(params, before):
            in_fp8.data.copy_(old_fp8)
            in_f32.data.copy_(old_f32)


def check_fp8_bias_file(mode: str, name: str, fp8, f32, conds) -> None:
    saved = snapshot(fp8.model)
    base = sample(fp8, conds)
    (patched,) = execute(LycorisLoaderModelOnly, model=fp8, lycoris_name=name, strength_model=0.75,
                         apply_mode=mode).result
    got = sample(patched, conds)
    truth = sample(loader(f32, None, name, 0.75, mode="merge")[0], conds)
    assert_matches(got, truth, base, f"{mode} on fp8 vs merge into float")
    assert patched.patches == {}  # nothing merged: the weight diffs too run in the forward
    sample(patched, conds)
    assert changed_keys(fp8.model, saved) == set()  # while loaded: the fp8 weights and biases are bit-identical
    comfy.model_management.unload_all_models()
    assert_no_bypass_left(fp8.model)
    assert changed_keys(fp8.model, saved) == set()


def test_bias_changes_in_the_forward_equal_the_merged_layer_in_order():
    """lycoris_core.bypass with bias contributions on a 3×3 conv, chained like merges: PEFT's (IA)³ (W and b scaled
    per output channel, b' = l·b, read from the bias), then a full diff with its bias diff on rows 2…5 (a fused
    weight's slice). Truth: the float64 conv with W and b changed by hand."""
    gen = torch.Generator().manual_seed(7)
    weight, bias, x = (torch.randn(8, 8, 3, 3, generator=gen) * 0.2, torch.randn(8, generator=gen),
                       torch.randn(2, 8, 5, 5, generator=gen))
    scales, diff, diff_b = torch.rand(8, generator=gen) + 0.5, torch.randn(4, 8, 3, 3, generator=gen) * 0.05, \
        torch.randn(4, generator=gen)
    modules = parse_state_dict({"base_model.model.conv.ia3_l": scales.reshape(1, 8, 1, 1),
                                "lora_unet_x.diff": diff, "lora_unet_x.diff_b": diff_b}, "chain.safetensors").modules
    m, m2 = 0.7, -1.3

    def part(key, shape, strength, rows=None):
        return Contribution(modules[key].plan_for(shape), modules[key].tensors, strength, rows)

    chain = [part("base_model.model.conv.weight", (8, 8, 3, 3), m), part("base_model.model.conv.bias", (8,), m),
             part("lora_unet_x.weight", (4, 8, 3, 3), m2, (2, 4)), part("lora_unet_x.bias", (4,), m2, (2, 4))]
    op = LayerOp(2, (1, 1), (1, 1), (1, 1))
    y = layer_output(x, lambda xi: torch.nn.functional.conv2d(xi, weight, bias, padding=1), op, chain, weight, bias)

    factor = (1 + m * (scales.double() - 1))
    w_truth, b_truth = weight.double() * factor.reshape(8, 1, 1, 1), bias.double() * factor
    w_truth[2:6] += m2 * diff.double()
    b_truth[2:6] += m2 * diff_b.double()
    truth = torch.nn.functional.conv2d(x.double(), w_truth, b_truth, padding=1)
    base = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    assert rel(y, truth) <= RTOL * rel(truth, base) and rel(truth, base) > MIN_CHANGE


def quantized_net(seed=0):
    """ComfyUI's fp8 layer kinds in one model: `q` a mixed-precision Linear holding a QuantizedTensor
    (float8_e4m3fn layout with a weight scale), `s` a scaled-fp8 Linear (fp8 weight × scale_weight), `f` a plain
    fp32 Linear of the mixed-precision ops class."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** -5

    def randn(*shape, s=0.3):
        return torch.randn(*shape, generator=gen) * s

    net = torch.nn.Module()
    net.q = quantized_linear(randn(16, 12), randn(16, s=0.1), torch.float8_e4m3fn, scale)
    net.f = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32).Linear(12, 16)
    net.f.load_state_dict({"weight": randn(16, 12), "bias": randn(16, s=0.1)})
    # 0.3.75: scaled_fp8_ops, a plain fp8 tensor; 0.33: another QuantizedTensor (what 0.33 loads scaled fp8 into)
    net.s = scaled_fp8_linear(randn(16, 12), randn(16, s=0.1), torch.float8_e4m3fn, scale)
    return net.requires_grad_(False)


def float_copy(net) -> torch.nn.Module:
    """`net` with every weight as the float32 its layer computes with, in plain fp32 Linear layers."""
    ref = torch.nn.Module()
    for name, layer in net.named_children():
        weight = layer.weight.dequantize() if isinstance(layer.weight, QuantizedTensor) else layer.weight.float()
        if hasattr(layer, "scale_weight"):
            weight = weight * layer.scale_weight
        plain = comfy.ops.disable_weight_init.Linear(12, 16)
        set_param(plain, "weight", weight, torch.float32)
        set_param(plain, "bias", layer.bias, torch.float32)
        ref.add_module(name, plain)
    return ref.requires_grad_(False)


def test_auto_bypasses_quantized_and_scaled_fp8_layers_and_merges_the_float_one():
    """Through a real ModelPatcher: auto bypasses the QuantizedTensor and the scaled-fp8 layer (weight-reading DoRA
    and OFT: they read the dequantized / unscaled weight), merges the fp32 one; each layer's output equals merging
    into a float32 copy, and the fp8 data stays bit-identical."""
    net = quantized_net()
    assert isinstance(net.q.weight, QuantizedTensor) and type(net.f.weight.data) is torch.Tensor
    assert fp8_storage(net.s)[0].dtype == torch.float8_e4m3fn
    stored = {name: bits(fp8_storage(getattr(net, name))[0]).clone() for name in ("q", "s")}
    variants = hand_variants()
    sd = {**{k.replace("lin.", "q.", 1): v for k, v in variants["dora-out"].items()},
          **{k.replace("lin.", "s.", 1): v for k, v in variants["diag-oft"].items()},
          **{k.replace("lin.", "f.", 1): v for k, v in variants["loha"].items()}}
    key_map = {name: f"{name}.weight" for name in ("q", "s", "f")}
    patches, report = lycoris_patches(sd, net, key_map)
    assert set(report.applied.values()) == set(key_map.values())

    ref = float_copy(net)
    x = inputs("lin")
    base = {name: getattr(ref, name)(x) for name in key_map}
    for name in ("q", "s"):  # the float copy computes what the fp8 layers compute
        assert_matches(getattr(net, name)(x), base[name], base[name], f"float copy of {name}", 1e-6, -1)
    ref_mp = patcher(ref)
    ref_mp.add_patches(lycoris_patches(sd, ref, key_map)[0], 0.7)
    full_load(ref_mp)
    truth = {name: getattr(ref, name)(x) for name in key_map}
    ref_mp.unpatch_model(CPU)

    patched, n_bypassed = patched_clone(patcher(net), patches, 0.7, apply_mode="auto", key="lycoris:quantized")
    assert n_bypassed == 2 and set(patched.patches) == {"f.weight"}
    full_load(patched)
    try:
        assert set(bypassed_layers(net)) == {"q", "s"}
        got = {name: getattr(net, name)(x) for name in key_map}
        assert isinstance(net.q.weight, QuantizedTensor)
        assert all(torch.equal(bits(fp8_storage(getattr(net, n))[0]), stored[n]) for n in stored)
    finally:
        patched.unpatch_model(CPU)
    assert_no_bypass_left(net)
    assert all(torch.equal(bits(fp8_storage(getattr(net, n))[0]), stored[n]) for n in stored)
    for name in key_map:
        assert_matches(got[name], truth[name], base[name], f"layer {name}")


def fp32_net(seed=3):
    """Two fp32 Linear layers of ComfyUI's ops, with biases: `a` for a LoHa, `b` for a full diff with a bias diff."""
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.Module()
    for name in ("a", "b"):
        layer = comfy.ops.disable_weight_init.Linear(12, 16)
        set_param(layer, "weight", torch.randn(16, 12, generator=gen) * 0.3, torch.float32)
        set_param(layer, "bias", torch.randn(16, generator=gen) * 0.1, torch.float32)
        net.add_module(name, layer)
    return net.requires_grad_(False)


@pytest.mark.skipif(not hasattr(comfy.model_management, "lora_compute_dtype"),
                    reason="ComfyUI 0.3.75 merges through an fp32 copy (it has no lora_compute_dtype)")
def test_auto_bypasses_fp32_layers_comfy_would_merge_through_fp16(monkeypatch):
    """ComfyUI 0.33 merges a fully loaded weight through a copy in lora_compute_dtype (fp16 on most NVIDIA GPUs), so
    an fp32 W is rounded to fp16 before any adapter runs. Auto then adds the change at run time (weights and bias
    diffs), says so in the report, and each layer computes what the fp32-copy merge computes."""
    variants = hand_variants()
    sd = {**{k.replace("lin.", "a.", 1): v for k, v in variants["loha"].items()},
          **{k.replace("lin.", "b.", 1): v for k, v in variants["full"].items()}}
    key_map = {name: f"{name}.weight" for name in ("a", "b")}
    x = inputs("lin")
    ref = fp32_net()
    base = {name: getattr(ref, name)(x) for name in key_map}
    ref_mp = patcher(ref)  # the truth: ComfyUI's merge through an fp32 copy (this CPU's lora_compute_dtype)
    ref_mp.add_patches(lycoris_patches(sd, ref, key_map)[0], 0.7)
    full_load(ref_mp)
    truth = {name: getattr(ref, name)(x) for name in key_map}
    ref_mp.unpatch_model(CPU)

    monkeypatch.setattr(comfy.model_management, "lora_compute_dtype", lambda device: torch.float16)
    net = fp32_net()
    patches, report = lycoris_patches(sd, net, key_map)
    patched, n_bypassed = patched_clone(patcher(net), patches, 0.7, apply_mode="auto", key="lycoris:fp32", report=report)
    full_load(patched)
    try:
        got = {name: getattr(net, name)(x) for name in key_map}
    finally:
        patched.unpatch_model(CPU)
    assert_no_bypass_left(net)
    for name in key_map:
        assert_matches(got[name], truth[name], base[name], f"layer {name}")
    assert n_bypassed == 3 and patched.patches == {}  # a.weight, b.weight and b.bias
    assert report.bypassed_formats == {"float32 merged by ComfyUI in float16": 3}


# --- 5. offloaded, and on another device than the adapter ------------------------------------------------------------

def test_offloaded_bypass_equals_merge(sd15, kinds, loras, conds):
    """Every layer offloaded (patch_model with 1 byte of VRAM): merge patches through LowVramPatch at each forward,
    bypass runs the adapters in the offloaded layers' forward (weight readers read the offloaded weight); one UNet
    evaluation each, and a full merge as truth."""
    model, _clip = sd15
    readers = {k: v for k, v in {**kinds["oft"], **kinds["lokr_dora"]}.items()
               if k.split(".")[0] in (OUT_SKIP, MID_FF)}
    name = write(loras, "offload.safetensors", {**kinds["loha"], **readers})  # + OFT and LoKr+DoRA: they read W
    merged, _ = loader(model, None, name, 1.5, mode="merge")
    bypassed, _ = loader(model, None, name, 1.5, mode="bypass", uid="71")
    comfy.model_management.unload_all_models()
    proj_out = model.model.get_submodule(UKEYS[PROJ_OUT].removesuffix(".weight"))

    def offloaded_as_expected(clone):
        assert proj_out.comfy_cast_weights and lowvram_patched(proj_out, "bias")  # the bias diff: merged
        assert lowvram_patched(proj_out) == (clone is merged)
        assert (ATTRIBUTE in proj_out.__dict__) == (clone is bypassed)

    results = {label: denoise_loaded(clone, load, conds, offloaded_as_expected if label.startswith("offloaded") else None)
               for label, clone, load in (("base", model, offload), ("full merge", merged, full_load),
                                          ("offloaded merge", merged, offload), ("offloaded bypass", bypassed, offload))}
    assert_no_bypass_left(model.model)
    assert_matches(results["offloaded merge"], results["full merge"], results["base"], "offloaded merge")
    assert_matches(results["offloaded bypass"], results["full merge"], results["base"], "offloaded bypass")


def test_bypassed_reader_after_a_merged_file_offloaded(sd15, kinds, loras, conds):
    """A merged LoCon (node 91) then a bypassed OFT (node 92) on the same layers: OFT reads W, and must read it as
    the layer runs it, W + the LoCon's change, whether that change was merged into the weight (full load) or is
    applied by ComfyUI's LowVramPatch at each forward (offloaded). Truth: both files merged. (Offloaded, the OFT
    read the stored weight without the LoCon's change, 1.8e-2 off for a change of 3.3e-1, until float_weight ran
    the layer's weight functions.)"""
    model, _clip = sd15
    a = write(loras, "mixed_locon.safetensors", unet_only(kinds["locon"]))
    b = write(loras, "mixed_oft.safetensors", kinds["oft"])
    m1, _ = loader(model, None, a, 0.8, mode="merge", uid="91")
    both_merged, _ = loader(m1, None, b, 1.25, mode="merge", uid="92")
    mixed, _ = loader(m1, None, b, 1.25, mode="bypass", uid="92")
    assert set(mixed.patches) == set(m1.patches) and set(mixed.injections) == {"lycoris:92"}
    comfy.model_management.unload_all_models()
    results = {label: denoise_loaded(clone, load, conds)
               for label, clone, load in (("base", model, offload), ("truth", both_merged, full_load),
                                          ("full", mixed, full_load), ("offloaded", mixed, offload))}
    assert_no_bypass_left(model.model)
    assert_matches(results["full"], results["truth"], results["base"], "merged then bypassed, full load")
    assert_matches(results["offloaded"], results["truth"], results["base"], "merged then bypassed, offloaded")


BYPASSABLE = [v for v in hand_variants() if v != "norm"]  # norm layers are always merged


@pytest.mark.parametrize("variant", BYPASSABLE)
def test_bypass_on_fake_cuda_with_the_adapter_on_the_cpu(variant):
    """The compute device cuda:0 (FakeTensorMode: device checks without a GPU), the layer offloaded and the adapter's
    tensors on the CPU: the bypass forward casts them to the input's device instead of raising."""
    sd = hand_variants()[variant]
    layer_name = layer_of(sd)
    net = Net(torch.bfloat16)
    patches, report = lycoris_patches(sd, net, KEY_MAP)
    assert not report.problems
    patched, n_bypassed = patched_clone(patcher(net), patches, 0.7, apply_mode="bypass", key="lycoris:fake")
    assert n_bypassed == 1
    offload(patched)
    layer = getattr(net, layer_name)
    try:
        (entry,) = layer.__dict__[ATTRIBUTE].entries.values()
        assert layer.weight.device == CPU and all(t.device == CPU for t in entry.tensors.values())
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = inputs(layer_name, torch.bfloat16, device="cuda:0")
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                x + torch.zeros(x.shape[-1], dtype=x.dtype)  # a CPU tensor meeting the input: the mode checks
            y = layer(x)
            assert y.device == torch.device("cuda:0") and y.dtype == torch.bfloat16
    finally:
        patched.unpatch_model(CPU)
    assert_no_bypass_left(net)


# --- 6. the report and the panel -------------------------------------------------------------------------------------

def test_report_line_and_panel_count_bypassed_patches(sd15, kinds, loras):
    model, clip = sd15
    locon = write(loras, "report_locon.safetensors", kinds["locon"])  # 4 UNet modules + 1 text-encoder module
    loha = write(loras, "report_loha.safetensors", kinds["loha"])  # 4 weights (bypassed) and a bias (merged)
    expected = [(locon, "bypass", 5), (locon, "merge", 0), (locon, "auto", 0), (loha, "bypass", 4)]
    for name, mode, n in expected:
        out = execute(LycorisLoader, "81", model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                      strength_clip=1.0, apply_mode=mode)
        data = json.loads(json.dumps(out.ui["lycoris"][0]))  # what the panel receives
        assert data["bypassed"] == n, (name, mode)
        assert data["applied"] == data["total"] and data["problems"] == []
        if n:
            assert data["line"].endswith(f", {n} in bypass)"), data["line"]
        else:
            assert "bypass" not in data["line"], data["line"]

