"""Stacks (LycorisStack → LORA_STACK → LycorisApplyStack) and strength schedules (LycorisHook + LycorisFade as ComfyUI
HOOKS) on the tiny real SD1.5.

Truth: chained LyCORIS Loaders (bitwise, the documented equivalence), GLoRA's sequential composition in float64 with
the reference's own GLoRA formula (lycoris-lora 4.1.3 `_glora_weight`), and W0 + s·(alpha/r)·up@down in float64 for
the hooked LoRA weights. Schedules run through ComfyUI's own sampler and hook machinery
(`ConditioningSetProperties`, `SetClipHooks`, `ModelPatcher.register_all_hook_patches` /
`prepare_hook_patches_current_keyframe` / `patch_hooks`).
"""

import itertools

import comfy.hooks
import comfy.model_management
import comfy.utils
import pytest
import test_block_weights
import test_nodes
import torch
from comfy_extras.nodes_hooks import ConditioningSetProperties, SetClipHooks
from lycoris.modules.glora import _glora_weight
from lycoris_nodes.lycoris_core import LycorisError, apply, parse_state_dict
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.scheduling.schedule import LycorisFade, LycorisHook
from lycoris_nodes.nodes.scheduling.stack import LycorisApplyStack, LycorisStack
from patcher_util import assert_rounded_from
from safetensors.torch import load_file
from test_block_weights import TE_LAYERS, UNET_LAYERS, loaded_weights, make_reference, model_key, run, same_bits
from test_nodes import lora, lora_delta64, write
from torch.utils.flop_counter import FlopCounterMode

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras
no_panel_measurement = test_block_weights.no_panel_measurement  # autouse

UNET_KEYS = [model_key(f"unet.{p}") for p in UNET_LAYERS]
TE_KEYS = [model_key(f"te.{p}") for p in TE_LAYERS]
TO_Q_PATH = "unet.input_blocks.1.1.transformer_blocks.0.attn1.to_q"
TO_Q_KEY = model_key(TO_Q_PATH)


@pytest.fixture(scope="module")
def files(sd15, tmp_path_factory):
    """Real lycoris-lora files for the tiny SD1.5: two different GLoRA files, a LoKr+DoRA and a LoCon."""
    directory = tmp_path_factory.mktemp("stack_reference")
    return {"glora_a": make_reference("glora", *sd15, directory, seed=1),
            "glora_b": make_reference("glora", *sd15, directory, seed=2),
            "lokr_dora": make_reference("lokr_dora", *sd15, directory),
            "locon": make_reference("locon", *sd15, directory)}


@pytest.fixture()
def installed(files, loras):
    return {key: ref.install(loras, f"{key}.safetensors") for key, ref in files.items()}


def weights(model, clip) -> dict[str, torch.Tensor]:
    out = loaded_weights(model, UNET_KEYS)
    if clip is not None:
        out.update(loaded_weights(clip.patcher, TE_KEYS))
    return out


def chained(model, clip, rows):
    for name, strength_model, strength_clip in rows:
        model, clip = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=strength_model,
                          strength_clip=strength_clip)
    return model, clip


def assert_same_weights(a: dict, b: dict, what: str):
    differ = [k for k in a if not same_bits(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} weights differ, e.g. {differ[:2]}"


# --- stacks ------------------------------------------------------------------------------------------------------------

def test_stack_rows_are_plain_three_tuples(installed):
    text = "\n".join([
        f"{installed['glora_a']} | 0.75 | 0.5",
        f"# {installed['locon']} | 1.0",  # off
        "",
        f"  {installed['lokr_dora']} | -0.5  ",  # clip strength defaults to the model strength
        f"{installed['glora_b']}",  # both default to 1
        f"{installed['locon']} | | 0.25 | te=0",  # empty model strength: 1
    ])
    (stack,) = run(LycorisStack, stack=text)
    assert [tuple(row) for row in stack] == [(installed["glora_a"], 0.75, 0.5), (installed["lokr_dora"], -0.5, -0.5),
                                             (installed["glora_b"], 1.0, 1.0), (installed["locon"], 1.0, 0.25)]
    assert all(isinstance(row, tuple) and len(row) == 3 for row in stack)  # what other packs unpack
    name, strength_model, strength_clip = stack[-1]
    assert (name, strength_model, strength_clip) == (installed["locon"], 1.0, 0.25)
    assert [getattr(row, "block_weights", None) for row in stack] == ["", "", "", "te=0"]

    (extended,) = run(LycorisStack, stack=f"{installed['locon']} | 2", lora_stack=[("other.safetensors", 0.3, 0.3)])
    assert [tuple(r) for r in extended] == [("other.safetensors", 0.3, 0.3), (installed["locon"], 2.0, 2.0)]


def test_apply_stack_equals_chained_loaders(sd15, installed):
    model, clip = sd15
    rows = [(installed["glora_a"], 0.75, 0.5), (installed["lokr_dora"], -0.5, -0.5), (installed["glora_b"], 1.5, 1.0)]
    text = "\n".join([f"{rows[0][0]} | 0.75 | 0.5", f"# {installed['locon']} | 1", f"{rows[1][0]} | -0.5",
                      f"{rows[2][0]} | 1.5 | 1.0"])
    (stack,) = run(LycorisStack, stack=text)
    stacked_model, stacked_clip = run(LycorisApplyStack, model=model, clip=clip, lora_stack=stack,
                                      strength_mode="linear")
    by_stack = weights(stacked_model, stacked_clip)
    by_chain = weights(*chained(model, clip, rows))
    assert_same_weights(by_stack, by_chain, "stack vs chained loaders")
    with_locon = weights(*chained(model, clip, [rows[0], (installed["locon"], 1.0, 1.0), *rows[1:]]))
    assert not all(same_bits(by_stack[k], with_locon[k]) for k in by_stack), "the '#' row must be off"


def test_glora_order_matters_as_documented(sd15, installed, files):
    """GLoRA's change depends on the weight as it stands (ΔW = γ(W·a1·a2 + b1·b2)), so A then B ≠ B then A; each
    order equals the sequential composition computed here in float64 with the reference's GLoRA formula."""
    model, _clip = sd15
    a, b = (installed["glora_a"], 0.75, 0.0), (installed["glora_b"], 1.5, 0.0)
    (ab,) = run(LycorisStack, stack=f"{a[0]} | 0.75 | 0\n{b[0]} | 1.5 | 0")
    (ba,) = run(LycorisStack, stack=f"{b[0]} | 1.5 | 0\n{a[0]} | 0.75 | 0")
    w_ab = weights(run(LycorisApplyStack, model=model, lora_stack=ab)[0], None)
    w_ba = weights(run(LycorisApplyStack, model=model, lora_stack=ba)[0], None)
    assert_same_weights(w_ab, weights(chained(model, None, [a, b])[0], None), "A,B vs chained loaders")
    assert_same_weights(w_ba, weights(chained(model, None, [b, a])[0], None), "B,A vs chained loaders")
    key = model_key(TO_Q_PATH)
    assert not torch.equal(w_ab[key], w_ba[key])

    def delta(ref, w):  # the reference's GLoRA change of weight w, from the file's tensors, in float64
        prefix = "lora_unet_" + TO_Q_PATH.removeprefix("unet.").replace(".", "_")
        t = {k.removeprefix(prefix + "."): v.double() for k, v in load_file(ref.file).items() if k.startswith(prefix)}
        (module,) = [lo for lo in ref.net.loras if lo.lora_name.endswith(prefix.removeprefix("lora_unet_"))]
        gamma = float(t["alpha"]) / module.lora_dim
        assert gamma == pytest.approx(float(module.scale))
        return _glora_weight(w, t["a1.weight"], t["a2.weight"], t["b1.weight"], t["b2.weight"], None, gamma)

    w0 = files["glora_a"].w0[TO_Q_PATH]
    ra, rb = files["glora_a"], files["glora_b"]
    after_a = w0 + 0.75 * delta(ra, w0)
    after_b = w0 + 1.5 * delta(rb, w0)
    truth_ab = after_a + 1.5 * delta(rb, after_a)
    truth_ba = after_b + 0.75 * delta(ra, after_b)
    assert float((truth_ab - truth_ba).norm() / (truth_ab - w0).norm()) > 1e-3  # the orders really differ
    assert_rounded_from(w_ab[key], truth_ab, torch.float32, slack=3e-5, what="A then B")
    assert_rounded_from(w_ba[key], truth_ba, torch.float32, slack=3e-5, what="B then A")


def test_lora_stack_from_another_pack(sd15, installed):
    """Other packs' LORA_STACK: a list of plain (name, strength_model, strength_clip) tuples (or lists)."""
    model, clip = sd15
    foreign = [(installed["locon"], 0.5, 1.25), [installed["lokr_dora"], 1.0, 0.5]]
    applied = weights(*run(LycorisApplyStack, model=model, clip=clip, lora_stack=foreign))
    assert_same_weights(applied, weights(*chained(model, clip, [tuple(r) for r in foreign])), "foreign stack")
    # extended by LyCORIS Stack: the incoming rows first
    (extended,) = run(LycorisStack, stack=f"{installed['locon']} | -0.5", lora_stack=foreign)
    applied = weights(*run(LycorisApplyStack, model=model, clip=clip, lora_stack=extended))
    rows = [tuple(r) for r in foreign] + [(installed["locon"], -0.5, -0.5)]
    assert_same_weights(applied, weights(*chained(model, clip, rows)), "extended foreign stack")


def test_block_weights_on_a_row(sd15, installed, files):
    model, clip = sd15
    bw = "te=0.25; middle_block=0; output_blocks.0-1=2"
    (stack,) = run(LycorisStack, stack=f"{installed['locon']} | 1 | 1\n{installed['lokr_dora']} | 0.75 | 2 | {bw}")
    by_stack = weights(*run(LycorisApplyStack, model=model, clip=clip, lora_stack=stack))
    m1, c1 = run(LycorisLoader, model=model, clip=clip, lycoris_name=installed["locon"], strength_model=1.0,
                 strength_clip=1.0)
    m2, c2 = run(LycorisBlockWeights, model=m1, clip=c1, lycoris_name=installed["lokr_dora"], strength_model=0.75,
                 strength_clip=2.0, block_weights=bw, preset="custom")
    assert_same_weights(by_stack, weights(m2, c2), "row block weights vs LyCORIS Loader (Block Weights)")
    only_locon = weights(m1, c1)
    mid = model_key("unet.middle_block.1.proj_out")
    assert same_bits(by_stack[mid], only_locon[mid])  # the row's middle block weighted 0: only LoCon's change
    assert not same_bits(by_stack[TE_KEYS[0]], only_locon[TE_KEYS[0]])


def test_glora_patch_costs_what_the_reference_costs():
    """One GLoRA patch, ΔW = γ(W·a1·a2 + b1·b2), costs at most twice the reference's three products (W·a1,
    (W·a1)·a2, b1·b2: 2·out·in·r FLOPs each), counted by FlopCounterMode, and is the reference's formula in float64
    rounded to float32 (the in×in product a1·a2, once formed first, cost 68 GFLOP on an SDXL layer instead of 0.2)."""
    out, inn, rank = 64, 2048, 4
    gen = torch.Generator().manual_seed(7)
    t = {"a1.weight": torch.randn(inn, rank, generator=gen) / inn ** 0.5,
         "a2.weight": torch.randn(rank, inn, generator=gen) / rank ** 0.5,
         "b1.weight": torch.randn(out, rank, generator=gen) / rank ** 0.5,
         "b2.weight": torch.randn(rank, inn, generator=gen) / inn ** 0.5}
    lfile = parse_state_dict({**{f"m.{k}": v for k, v in t.items()}, "m.alpha": torch.tensor(2.0)}, "glora.safetensors")
    (module,) = lfile.modules.values()
    plan = module.plan_for((out, inn), reference=False)
    w0 = torch.randn(out, inn, generator=gen) / inn ** 0.5
    w = w0.clone()
    with FlopCounterMode(display=False) as counter:
        apply(plan, module.tensors, w, 1.0)
    truth = w0.double() + _glora_weight(w0.double(), *(t[k].double() for k in t), None, 2.0 / rank)
    assert_rounded_from(w, truth, torch.float32, slack=3e-5, what="GLoRA")
    reference_cost = 3 * 2 * out * inn * rank  # W·a1, (W·a1)·a2, b1·b2
    assert counter.get_total_flops() <= 2 * reference_cost, (
        f"{counter.get_total_flops() / 1e6:.0f} MFLOP for one GLoRA patch; the reference needs "
        f"{reference_cost / 1e6:.1f}")


@pytest.mark.parametrize("line,message", [
    ("no_such_file.safetensors | 1", "'no_such_file.safetensors' is not a file in the loras folders"),
    ("{locon} | strong", "'strong' is not a strength"),
    ("{locon} | 1 | 1 | input_blocks=lots", "'lots' is not a number"),
])
def test_stack_errors_at_the_stack_node(line, message, installed):
    with pytest.raises(LycorisError, match=message):
        run(LycorisStack, stack=f"{installed['glora_a']} | 1\n" + line.format(locon=installed["locon"]))


# --- schedules ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start,end,start_percent,end_percent,n,expected", [
    (0.0, 1.0, 0.0, 1.0, 5, [(0.0, 0.0), (0.25, 0.25), (0.5, 0.5), (0.75, 0.75), (1.0, 1.0)]),
    # a fade starting later holds strength_start from 0 % on (a keyframe at 0)
    (1.0, 0.0, 0.2, 0.6, 3, [(1.0, 0.0), (1.0, 0.2), (0.5, 0.4), (0.0, 0.6)]),
    (0.25, 1.0, 0.0, 0.75, 4, [(0.25, 0.0), (0.5, 0.25), (0.75, 0.5), (1.0, 0.75)]),
    (2.0, 2.0, 0.5, 0.5, 2, [(2.0, 0.0), (2.0, 0.5), (2.0, 0.5)]),
])
def test_fade_keyframes(start, end, start_percent, end_percent, n, expected, installed):
    (hooks,) = run(LycorisHook, lycoris_name=installed["locon"], strength_model=1.0, strength_clip=1.0)
    (faded,) = run(LycorisFade, hooks=hooks, strength_start=start, strength_end=end, start_percent=start_percent,
                   end_percent=end_percent, keyframes=n)
    assert faded is not hooks and len(faded.hooks) == 1
    (hook,) = faded.hooks
    got = [(kf.strength, kf.start_percent) for kf in hook.hook_keyframe.keyframes]
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in expected for x in pair])
    assert hooks.hooks[0].hook_keyframe.keyframes == []  # the input hooks keep their (absent) schedule


def test_fade_end_before_start_is_an_error(installed):
    (hooks,) = run(LycorisHook, lycoris_name=installed["locon"], strength_model=1.0, strength_clip=1.0)
    with pytest.raises(LycorisError, match="end_percent 0.2 is before start_percent 0.6"):
        run(LycorisFade, hooks=hooks, strength_start=0.0, strength_end=1.0, start_percent=0.6, end_percent=0.2,
            keyframes=3)


MID = "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_v"
OUT = "lora_unet_output_blocks_1_1_proj_out"
TO_Q = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q"
SCHEDULE_KEYS = {TO_Q: (model_key(TO_Q_PATH), 0.5), MID: (model_key("unet.middle_block.1.transformer_blocks.0.attn2.to_v"), 0.0),
                 OUT: (model_key("unet.output_blocks.1.1.proj_out"), 2.0)}  # prefix -> (weight key, block weight)
SCHEDULE_BW = "input_blocks=0.5; middle_block=0; output_blocks.1=2"
HOOK_STRENGTH = 0.5
FADE = {"strength_start": 0.25, "strength_end": 1.0, "start_percent": 0.0, "end_percent": 0.75, "keyframes": 4}
KEYFRAME_STRENGTHS = (0.25, 0.5, 0.75, 1.0)  # dyadic, like the strengths: every product is exact in float


def _schedule_file(folder):
    sd = {**lora(TO_Q, 320, 320, seed=11), **lora(MID, 320, 768, seed=13, alpha=8.0),
          **lora(OUT, 320, 320, seed=15, kernel=(1, 1))}
    return write(folder, "scheduled.safetensors", sd), sd


def _loader_weights(model, name, strength, keys):
    """LyCORIS Loader (Block Weights) at a constant strength: the weights a keyframe must reproduce."""
    new_model, _ = run(LycorisBlockWeights, model=model, clip=None, lycoris_name=name, strength_model=strength,
                       strength_clip=0.0, block_weights=SCHEDULE_BW, preset="custom")
    return loaded_weights(new_model, keys)


def _hooks(name):
    (hooks,) = run(LycorisHook, lycoris_name=name, strength_model=HOOK_STRENGTH, strength_clip=1.0,
                   block_weights=SCHEDULE_BW)
    (hooks,) = run(LycorisFade, hooks=hooks, **FADE)
    return hooks


def test_schedule_during_sampling(sd15, loras):
    """4 sampling steps through ComfyUI's sampler with the hooked positive prompt (Cond Set Props): the weights the
    model runs with change with the keyframes, each step's weights are bitwise those of the Block Weights loader at
    keyframe × hook strength, and the unhooked negative prompt runs on the untouched weights."""
    model, _clip = sd15
    name, sd = _schedule_file(loras)
    keys = [key for key, _bw in SCHEDULE_KEYS.values()]
    w0 = {k: v.detach().clone() for k, v in model.model.state_dict().items() if k in keys}

    seen = []

    def wrapper(apply_model, args):
        seen.append((float(args["timestep"][0]), tuple(args["cond_or_uncond"]),
                     {k: comfy.utils.get_attr(clone.model, k).detach().clone() for k in keys}))
        return apply_model(args["input"], args["timestep"], **args["c"])

    clone = model.clone()
    clone.set_model_unet_function_wrapper(wrapper)
    gen = torch.Generator().manual_seed(0)
    cond = [[torch.randn(1, 77, 768, generator=gen) * 0.1, {}]]
    (positive,) = ConditioningSetProperties().set_properties(cond, strength=1.0, set_cond_area="default",
                                                             hooks=_hooks(name))
    negative = [[torch.zeros(1, 77, 768), {}]]
    latent = comfy_nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    out = comfy_nodes.common_ksampler(clone, 0, 4, 2.0, "euler", "simple", positive, negative, latent)[0]["samples"]
    assert bool(torch.isfinite(out).all())

    hooked = [(t, w) for t, which, w in seen if which == (0,)]
    unhooked = [w for _t, which, w in seen if which == (1,)]
    assert len(hooked) == 4 and len(unhooked) == 4, [(t, which) for t, which, _ in seen]
    for w in unhooked:
        assert all(same_bits(w[k], w0[k]) for k in keys), "the unhooked prompt must see the original weights"
    by_strength = {s: _loader_weights(model, name, s * HOOK_STRENGTH, keys) for s in KEYFRAME_STRENGTHS}
    steps = []
    for _t, w in hooked:
        matching = [s for s, ref in by_strength.items() if all(same_bits(w[k], ref[k]) for k in keys)]
        assert len(matching) == 1, f"step weights match loader strengths {matching}"
        steps.append(matching[0])
    # guarantee_steps = 1: each keyframe holds one step, in order (0 %, 25 %, 50 %, 75 % of 4 steps)
    assert steps == list(KEYFRAME_STRENGTHS)
    for (_t0, before), (_t1, after) in itertools.pairwise(hooked):  # so the weights change from step to step
        assert not same_bits(before[TO_Q_KEY], after[TO_Q_KEY])
    for (_t, w), s in zip(hooked, steps):  # and the float64 truth: W0 + keyframe·hook·block weight·ΔW
        for prefix, (key, bw) in SCHEDULE_KEYS.items():
            delta = lora_delta64(sd, prefix).reshape(w0[key].shape)
            if bw == 0:
                assert same_bits(w[key], w0[key]), "a block weighted 0 must stay untouched"
            else:
                assert_rounded_from(w[key], w0[key].double() + s * HOOK_STRENGTH * bw * delta, torch.float32)
    comfy.model_management.unload_all_models()
    assert all(same_bits(model.model.state_dict()[k], w0[k]) for k in keys), "sampling left hooked weights behind"


def test_schedule_by_percent_through_the_hook_api(sd15, loras, files):
    """The keyframes driven directly (register_all_hook_patches, prepare_hook_patches_current_keyframe, patch_hooks)
    at sigmas for 0/25/50/75 %, with a real LoKr+DoRA file: each keyframe's weights are bitwise the Block Weights
    loader's at keyframe × hook strength (linear strength: DoRA scales like the strength)."""
    model, _clip = sd15
    name = files["lokr_dora"].install(loras)
    keys = [k for k in UNET_KEYS if "middle_block" not in k]  # middle_block is weighted 0 below
    mid_keys = [k for k in UNET_KEYS if "middle_block" in k]
    (hooks,) = run(LycorisHook, lycoris_name=name, strength_model=HOOK_STRENGTH, strength_clip=1.0,
                   block_weights=SCHEDULE_BW)
    (hooks,) = run(LycorisFade, hooks=hooks, **FADE)
    patcher = model.clone()
    w0 = {k: comfy.utils.get_attr(patcher.model, k).detach().clone() for k in UNET_KEYS}
    patcher.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
    for hook in hooks.hooks:
        hook.initialize_timesteps(patcher.model)
    sampling = patcher.model.model_sampling
    sigmas = [float(sampling.sigma_max)] + [float(sampling.percent_to_sigma(p)) for p in (0.25, 0.5, 0.75)]
    options = {"transformer_options": {"sample_sigmas": torch.tensor([*sigmas, 0.0])}}
    try:
        for sigma, strength in zip(sigmas, KEYFRAME_STRENGTHS):
            patcher.prepare_hook_patches_current_keyframe(torch.tensor([sigma]), hooks, options)
            patcher.patch_hooks(hooks)
            got = {k: comfy.utils.get_attr(patcher.model, k).detach().clone() for k in UNET_KEYS}
            patcher.patch_hooks(None)
            expected = _loader_weights_unet(model, name, strength * HOOK_STRENGTH)
            assert_same_weights({k: got[k] for k in keys}, expected, f"keyframe {strength}")
            assert all(same_bits(got[k], w0[k]) for k in mid_keys)
    finally:
        patcher.clean_hooks()
    assert all(same_bits(comfy.utils.get_attr(patcher.model, k), w0[k]) for k in UNET_KEYS)


def _loader_weights_unet(model, name, strength):
    keys = [k for k in UNET_KEYS if "middle_block" not in k]
    return _loader_weights(model, name, strength, keys)


def test_clip_hook_with_block_weights(sd15, loras, files):
    """The text-encoder side: Set CLIP Hooks registers the hook on the CLIP's patcher; patched, its weights are
    bitwise the Block Weights loader's text-encoder weights at strength_clip × block weight."""
    _model, clip = sd15
    name = files["lokr_dora"].install(loras)
    bw = "te=0.5"
    (hooks,) = run(LycorisHook, lycoris_name=name, strength_model=1.0, strength_clip=1.5, block_weights=bw)
    (hooked_clip,) = SetClipHooks().apply_hooks(clip, schedule_clip=False, apply_to_conds=False, hooks=hooks)
    patcher = hooked_clip.patcher
    w0 = {k: comfy.utils.get_attr(patcher.model, k).detach().clone() for k in TE_KEYS}
    try:
        patcher.patch_hooks(patcher.forced_hooks)
        got = {k: comfy.utils.get_attr(patcher.model, k).detach().clone() for k in TE_KEYS}
    finally:
        patcher.clean_hooks()
    assert all(same_bits(comfy.utils.get_attr(patcher.model, k), w0[k]) for k in TE_KEYS)
    _m, loader_clip = run(LycorisBlockWeights, model=_model, clip=clip, lycoris_name=name, strength_model=0.0,
                          strength_clip=1.5, block_weights=bw, preset="custom")
    assert_same_weights(got, loaded_weights(loader_clip.patcher, TE_KEYS), "clip hook vs loader")
    assert not any(same_bits(got[k], w0[k]) for k in TE_KEYS)
