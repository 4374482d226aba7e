"""LightX2V's Wan distill LoRAs on the paths beyond a loader's full load: hooks (LyCORIS Hook and Fade), offloaded
and dynamic-VRAM loading with a strength change, GGUF models (the real ComfyUI-GGUF pack), torch.compile.

File and truth are tests/test_distill_diffs.py's: the file as LightX2V's extractor writes it (LoRAs on the blocks'
Linear weights, `.diff` / `.diff_b` elsewhere, `diff_m` on each block's and the head's `modulation`), the truth
LightX2V's own `apply_lora` (W + s·Δ, computed in float64). The modulation is a parameter of a module with children,
which ComfyUI's loading never patches: the loaders set it as an object patch (nodes/glue/object_params.py), while
ComfyUI's hooks write every hooked key into its parameter directly (`ModelPatcher.patch_hook_weight_to_device`,
`copy_to_param`), leaf or not, so the hooks need nothing of their own for it. Offloaded, ComfyUI leaves such a
parameter on the offload device and Wan's forward casts it to the block's device (`cast_to(self.modulation, ...)`);
0.33's dynamic load moves it to the load device in place (`_load_list(default_device=...)`), the object patch
included; a clone switch (a strength change) restores the previous clone's object patches first
(`unpatch_model(unpatch_weights=False)`). In a GGUF Wan the modulation is a plain float parameter. Nothing in the pack
needed a change for any of these paths: these tests are the proof.
"""

import contextlib
import io
import shutil

import comfy.hooks
import comfy.model_management
import comfy.model_patcher
import comfy.utils
import folder_paths
import pytest
import test_distill_diffs
import torch
import torch._dynamo
from comfy_api.torch_helpers import set_torch_compile_wrapper
from lycoris_nodes.nodes.glue.gguf import decoded, is_gguf_tensor
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from lycoris_nodes.nodes.scheduling.schedule import LycorisFade, LycorisHook
from node_runner import execute
from test_distill_diffs import (
    MODES,
    PREFIX,
    TOLERANCE,
    applied_fully,
    changes,
    check_weights,
    forward,
    forward_with,
    lightx2v_file,
    model_keys,
)
from test_nodes import run_node, write
from test_video_dit_peft import Arch, _wan, comfy_model

wan, loras = test_distill_diffs.wan, test_distill_diffs.loras  # fixtures
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths

CPU = torch.device("cpu")
MODULATIONS = tuple(PREFIX + k for k in ("blocks.0.modulation", "blocks.1.modulation", "head.modulation"))
FADE = {"strength_start": 0.25, "strength_end": 1.0, "start_percent": 0.0, "end_percent": 0.75, "keyframes": 4}
KEYFRAME_STRENGTHS = (0.25, 0.5, 0.75, 1.0)
HOOK_STRENGTH = 0.5
HOOK_BLOCK_WEIGHTS = "blocks.0=0.5; head=0"


def block_weight(key: str) -> float:
    """HOOK_BLOCK_WEIGHTS for a model key (without the diffusion_model. prefix)."""
    return 0.5 if key.startswith("blocks.0.") else 0.0 if key.startswith("head.") else 1.0


def installed(loras, base, seed: int, name: str):
    """(file name, its change per model key in float64)."""
    sd = lightx2v_file(base, seed=seed)
    return write(loras, name, sd), changes(sd, base)


def current(patcher, keys) -> dict[str, torch.Tensor]:
    return {k: comfy.utils.get_attr(patcher.model, k).detach().clone() for k in keys}


def check_modulations(patcher, base, delta, strength: float) -> None:
    """The modulations the loaded model holds: W + s·Δ (W at strength 0)."""
    short = [k[len(PREFIX):] for k in MODULATIONS]
    check_weights(current(patcher, MODULATIONS), {k: base[k] for k in short},
                  {k: delta[k] for k in short} if strength else {}, lambda key: strength)


def test_hook_and_fade_apply_the_modulation_at_each_keyframe(wan, loras):
    """LyCORIS Hook (strength 0.5, block weights) + Fade on a model an earlier loader patched (its modulation an
    object patch), driven as the sampler drives it (register_all_hook_patches, prepare_hook_patches_current_keyframe,
    patch_hooks): at each keyframe every parameter, the modulations included, is W + 0.5·Δ₁ + k·0.5·b·Δ₂ (b the
    block weight); the hooks taken off leave the loader's weights, unloading the model leaves W."""
    patcher, base = wan
    earlier, delta1 = installed(loras, base, 8, "earlier_distill.safetensors")
    hooked, delta2 = installed(loras, base, 7, "hooked_distill.safetensors")
    loaded = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=earlier, strength_model=0.5)[0]
    (hooks,) = run_node(LycorisHook, lycoris_name=hooked, strength_model=HOOK_STRENGTH, strength_clip=1.0,
                        block_weights=HOOK_BLOCK_WEIGHTS)
    (hooks,) = run_node(LycorisFade, hooks=hooks, **FADE)
    after_loader = {k: v.double() + 0.5 * delta1[k] for k, v in base.items()}
    keys = model_keys(base)
    hooked_delta = {k: v for k, v in delta2.items() if block_weight(k) != 0}
    loaded.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        before = current(loaded, keys)  # what a block weighted 0 (the head) keeps, bit for bit
        expected_base = {k: after_loader[k] if k in hooked_delta else before[PREFIX + k] for k in base}
        loaded.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
        registered = loaded.hook_patches[hooks.hooks[0].hook_ref]
        assert set(MODULATIONS) - {PREFIX + "head.modulation"} <= set(registered)  # the head is weighted 0
        for hook in hooks.hooks:
            hook.initialize_timesteps(loaded.model)
        sampling = loaded.model.model_sampling
        sigmas = [float(sampling.sigma_max)] + [float(sampling.percent_to_sigma(p)) for p in (0.25, 0.5, 0.75)]
        options = {"transformer_options": {"sample_sigmas": torch.tensor([*sigmas, 0.0])}}
        for sigma, k in zip(sigmas, KEYFRAME_STRENGTHS):
            loaded.prepare_hook_patches_current_keyframe(torch.tensor([sigma]), hooks, options)
            loaded.patch_hooks(hooks)
            check_weights(current(loaded, keys), expected_base, hooked_delta,
                          lambda key, k=k: k * HOOK_STRENGTH * block_weight(key))
            loaded.patch_hooks(None)
        check_weights(current(loaded, keys), base, delta1, lambda key: 0.5)
    finally:
        loaded.clean_hooks()
        loaded.unpatch_model(CPU)
    assert all(torch.equal(comfy.utils.get_attr(patcher.model, PREFIX + k), v) for k, v in base.items())
    comfy.model_management.unload_all_models()


# --- offloaded and dynamic-VRAM loading, with a strength change -------------------------------------------------------

HAS_DYNAMIC = hasattr(comfy.model_patcher, "ModelPatcherDynamic")
SWITCHES = (1.0, 0.5, 0.0)  # a strength change, then the plain model (strength 0: the loader hands its input back)


def switched(model, previous):
    """`model` loaded offloaded (every layer's weights on the offload device, patches in LowVramPatch) after
    `previous`, as load_models_gpu switches between clones of one model: the old clone detached without unpatching,
    the new one's LoadedModel.model_load (partially_load: unpatch, patch_model, load)."""
    if previous is not None:
        previous.model.detach(unpatch_all=False)
    loaded = comfy.model_management.LoadedModel(model)
    loaded.model_load(lowvram_model_memory=1)
    assert model.model.model_lowvram
    return loaded


def test_offloaded_model_runs_the_modulation_after_a_strength_change(wan, loras):
    """Loader at 1, then 0.5, then the plain model, each loaded offloaded after the previous one: the output is the
    true weights' output each time (the modulation the block reads included), and the original model's in the end."""
    patcher, base = wan
    name, delta = installed(loras, base, 7, "wan_distill_lightx2v.safetensors")
    truths = {s: forward_with(patcher, {k: (v.double() + s * delta[k]).float() for k, v in base.items()})
              for s in SWITCHES}
    scale = (truths[1.0] - truths[0.0]).abs().max()
    previous = None
    try:
        for s in SWITCHES:
            model = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=s)[0]
            previous = switched(model, previous)
            assert (forward(model) - truths[s]).abs().max() <= TOLERANCE * scale, f"strength {s}"
            check_modulations(model, base, delta, s)
    finally:
        previous.model.detach(unpatch_all=True)
    assert all(torch.equal(comfy.utils.get_attr(patcher.model, PREFIX + k), v) for k, v in base.items())
    comfy.model_management.unload_all_models()


def as_dynamic(model):
    """`model` behaving as 0.33's ModelPatcherDynamic towards loading (on a CPU ModelPatcherDynamic(...) returns a
    plain ModelPatcher): its own partially_load, patch_model and unpatch_model, and of its `load` the part that
    concerns a parameter of a module with children (`_load_list(for_dynamic=True, default_device=...)` moves it to
    the load device in its model dtype); the vbar part needs an NVIDIA GPU and comfy-aimdo and only concerns
    comfy.ops layers (tests/test_bypass_dynamic.py drives those)."""

    class CpuDynamic(comfy.model_patcher.ModelPatcherDynamic):
        def load(self, device_to=None, *args, dirty=False, **kwargs):
            self._load_list(for_dynamic=True, default_device=device_to)

    model.__class__ = CpuDynamic
    return model


@pytest.mark.skipif(not HAS_DYNAMIC, reason="ComfyUI 0.3.75 has no dynamic VRAM loading (ModelPatcherDynamic)")
def test_dynamic_loading_swaps_the_modulation_with_the_strength(wan, loras):
    """0.33's dynamic load after a strength change: the modulation each block reads is W + s·Δ of the clone being
    loaded (the previous clone's object patch taken out), on the load device; W again for the plain model."""
    patcher, base = wan
    name, delta = installed(loras, base, 7, "wan_distill_lightx2v.safetensors")
    previous = None
    try:
        for s in SWITCHES:
            model = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=s)[0]
            model = as_dynamic(model.clone())
            if previous is not None:
                previous.detach(unpatch_all=False)
            model.partially_load(CPU)
            assert all(comfy.utils.get_attr(model.model, k).device == CPU for k in MODULATIONS)
            check_modulations(model, base, delta, s)
            previous = model
    finally:
        if previous is not None:  # ModelPatcherDynamic's own full unpatch frees comfy-aimdo's pins
            previous.__class__ = comfy.model_patcher.ModelPatcher
            previous.unpatch_model(CPU)
    assert all(torch.equal(comfy.utils.get_attr(patcher.model, PREFIX + k), v) for k, v in base.items())
    comfy.model_management.unload_all_models()


# --- GGUF --------------------------------------------------------------------------------------------------------------

# What ComfyUI's detection reads back from a Wan state dict (comfy/model_detection.py: num_heads = dim // 128,
# freq_dim 256, WanModel's default text_dim 4096): the smallest Wan a GGUF loader can load.
GGUF_WAN = Arch("WAN21_T2V", _wan(dim=256, num_heads=2, freq_dim=256, text_dim=4096), "", "", {}, "", ())
# ComfyUI-GGUF's tools/lcpp.patch (`llama_model_quantize_internal`, LLM_ARCH_WAN): what its llama.cpp never quantizes
WAN_KEPT = ("modulation.", "patch_embedding.", "text_embedding.", "time_projection.", "time_embedding.", "img_emb.",
            "head.")


def llama_cpp_quantizes(name: str, data) -> bool:
    """lcpp.patch: image models' 2-D tensors only (so never a 3-D modulation), none of WAN_KEPT."""
    return data.ndim == 2 and not any(part in name for part in WAN_KEPT)


def write_wan_gguf(state_dict: dict, folder, tools) -> str:
    """The pack's tools/convert.py (`handle_tensors`, ModelWan: `.modulation` kept F32 as `keys_hiprec`) to F16, its
    5-D patch embedding added back in F32 as tools/fix_5d_tensors.py adds it, then Q8_0 as lcpp.patch quantizes."""
    gguf, convert = tools.gguf, tools._convert_module()
    five_d = {}

    class Wan(convert.ModelWan):
        def handle_nd_tensor(self, key, data):  # convert.py sets 5-D tensors aside for fix_5d_tensors.py
            five_d[key] = data

    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # a line per tensor
        convert.handle_tensors(writer, state_dict, Wan())
    f32 = gguf.GGMLQuantizationType.F32
    for key, data in five_d.items():  # fix_5d_tensors.py's add_extra_key
        writer.add_tensor(key, gguf.quants.quantize(data, f32), raw_dtype=f32)
    tools._write(writer, folder / "wan-F16.gguf")
    tools.requantize(folder / "wan-F16.gguf", folder / "wan-Q8_0.gguf", "Q8_0", llama_cpp_quantizes)
    return "wan-Q8_0.gguf"


def decoded_state(model) -> dict[str, torch.Tensor]:
    """The diffusion model's parameters as its forward reads them: GGUF tensors decoded by the pack's own decoder."""
    out = {}
    for path, module in model.model.diffusion_model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            key = f"{path}.{name}" if path else name
            out[key] = decoded(module, param) if is_gguf_tensor(param) else param.detach().float().clone()
    return out


def f16_tensors(model) -> set[str]:
    """Keys of the GGUF tensors stored as F16 (the pack keeps those as float16 data, patched in place)."""
    return {k for k, p in model.model.diffusion_model.named_parameters() if is_gguf_tensor(p)
            and p.dtype == torch.float16}


@pytest.fixture(scope="module")
def gguf_wan(tmp_path_factory):
    """(Wan from the pack's UnetLoaderGGUF on a Q8_0 file, a float Wan holding its decoded weights, those weights)."""
    import test_gguf  # skips (fails under CI) without gguf-py: imported here so the other tests still run

    loader = test_gguf.gguf_pack()
    folder = tmp_path_factory.mktemp("gguf_wan")
    plain = comfy_model(GGUF_WAN)
    name = write_wan_gguf({k: v.detach().clone() for k, v in plain.diffusion_model.state_dict().items()}, folder,
                          test_gguf)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("diffusion_models", "unet_gguf"):
            mp.setitem(folder_paths.folder_names_and_paths, key, ([str(folder)], {".gguf"}))
        mp.setattr(folder_paths, "filename_list_cache", {})
        model = execute(loader(), unet_name=name)[0]
    base = decoded_state(model)
    plain.diffusion_model.load_state_dict(base)
    yield model, comfy.model_patcher.ModelPatcher(plain, load_device=CPU, offload_device=CPU), base
    comfy.model_management.unload_all_models()


def test_gguf_wan_holds_its_modulation_as_a_plain_parameter(gguf_wan):
    """The question the object patch depends on: ComfyUI-GGUF's tools never quantize a modulation (convert.py keeps
    it F32, lcpp.patch quantizes 2-D tensors only), and the pack's loader copies it into the model's own float
    Parameter (torch's load_state_dict; only GGMLOps layers keep GGMLTensors): never a GGUF tensor. (A file with a
    quantized modulation does not load at all: its packed shape fails that copy.)"""
    model, _, _ = gguf_wan
    wan = model.model.diffusion_model
    assert wan.blocks[0].self_attn.q.weight.tensor_type.name == "Q8_0"  # the blocks' Linear weights are quantized
    for key in MODULATIONS:
        param = comfy.utils.get_attr(model.model, key)
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32 and not is_gguf_tensor(param)


@pytest.mark.parametrize("mode", MODES)
def test_lightx2v_file_on_a_gguf_wan(mode, gguf_wan, loras):
    """The LightX2V file at 0.5 on the Q8_0 Wan: every module applies, the modulation (an object patch) is the
    decoded W + 0.5·Δ, and the model's output is the output of the decoded weights + 0.5·Δ (LoRAs on quantized
    layers merged as GGUF patches, or bypassed); in merge and auto, the F16 tensors hold W + 0.5·Δ rounded to F16,
    as any merge into a float16 weight does."""
    model, plain, base = gguf_wan
    sd = lightx2v_file(base)
    name = write(loras, "wan_gguf_distill.safetensors", sd)
    applied_fully(loras, name, model)
    assert f16_tensors(model)  # so merge and auto round some weights
    delta = changes(sd, base)
    patched = run_node(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=0.5, apply_mode=mode)[0]
    true = {k: (v.double() + 0.5 * delta[k]).float() for k, v in base.items()}
    if mode != "bypass":  # a merge into an F16 tensor (the embeddings and head.head lcpp.patch leaves unquantized) is
        # W' rounded to nearest, as ComfyUI-GGUF's patch_weight_to_device stores it (stochastic_rounding to float16)
        true.update({k: true[k].half().float() for k in f16_tensors(model)})
    truth = forward_with(plain, true)
    scale = (truth - forward_with(plain, base)).abs().max()
    patched.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        check_modulations(patched, base, delta, 0.5)
        assert (forward(patched) - truth).abs().max() <= TOLERANCE * scale
    finally:
        patched.unpatch_model(CPU)
    comfy.model_management.unload_all_models()


# --- torch.compile -----------------------------------------------------------------------------------------------------

def compiled_frames() -> int:
    return sum(torch._dynamo.utils.counters["frames"].values())


def sampled(patcher) -> torch.Tensor:
    """forward() as the sampler runs it: loaded by load_models_gpu, the patcher's wrappers (torch.compile's among
    them) in transformer_options (comfy/sampler_helpers.py `prepare_model_patcher`)."""
    comfy.model_management.load_models_gpu([patcher])
    return forward(patcher, {"wrappers": patcher.wrappers})


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="inductor on the CPU needs a C++ "
                    "compiler")
def test_torch_compile_runs_the_modulation_and_counts_recompiles(wan, loras):
    """ComfyUI's torch.compile wrapper (comfy_api.torch_helpers `set_torch_compile_wrapper`, what TorchCompileModel
    calls, inductor) on the head (its `modulation` an object patch, `head.head` a merged `.diff`): one compile, kept
    to the head so the test takes one inductor graph (13–40 s cold on 2 cores; TorchCompileModel's whole tiny Wan:
    23 graphs, ~3 min). The output is the true weights' output at strength 1, again at 1, then at 0.5; neither the identical
    re-run nor the strength change compiles a frame (the baseline measured for issue #35 on torch 2.14: a new
    parameter object of the same shape and dtype passes dynamo's guards; TorchCompileModel on the whole tiny Wan
    measured the same, 0 and 0)."""
    patcher, base = wan
    name, delta = installed(loras, base, 7, "wan_distill_lightx2v.safetensors")
    compiled = patcher.clone()
    set_torch_compile_wrapper(compiled, backend="inductor", keys=["diffusion_model.head"])
    truths = {s: forward_with(patcher, {k: (v.double() + s * delta[k]).float() for k, v in base.items()})
              for s in (0.0, 0.5, 1.0)}
    scale = (truths[1.0] - truths[0.0]).abs().max()
    new_frames = []
    try:
        for s in (1.0, 1.0, 0.5):
            model = run_node(LycorisLoaderModelOnly, model=compiled, lycoris_name=name, strength_model=s)[0]
            before = compiled_frames()
            out = sampled(model)
            new_frames.append(compiled_frames() - before)
            assert (out - truths[s]).abs().max() <= TOLERANCE * scale, f"strength {s}"
    finally:
        comfy.model_management.unload_all_models()
        torch._dynamo.reset()
    assert new_frames[0] > 0, "the head was not compiled"
    assert new_frames[1:] == [0, 0], f"frames compiled at the re-run and the strength change: {new_frames[1:]}"
