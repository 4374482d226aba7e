"""Adapters on GGUF models loaded by the real ComfyUI-GGUF pack (city96, `../shared/comfyui-gguf/`), issue #15.

The pack is unpacked by scripts/setup.sh into `.deps/custom_nodes/ComfyUI-GGUF` and loaded once per session with
ComfyUI's own `nodes.load_custom_node`; models come from its `UnetLoaderGGUF` node. The GGUF files are written by
real tools: the pack's `tools/convert.py` turns the tiny SD1.5 UNet into an F16 GGUF (its architecture named, as
its detection needs `input_blocks.3.0.op`, which the one-level model lacks), and gguf-py's own quantizer, reader and
writer re-quantize that file to Q8_0 and Q4_0 as convert.py writes tensors.

Files: real lycoris-lora 4.1.3 networks on float copies of the UNet's Linear/Conv layers. Truth: the reference's own
forward on those layers holding the DEQUANTIZED weights (the pack's decoder), so a cell is exact or wrong; no format
floor applies, except where a merge rounds W' into an F16 weight (asserted as that rounding).
"""

import asyncio
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shutil
from dataclasses import dataclass, field

import comfy.model_management
import folder_paths
import numpy as np
import pytest
import test_nodes
import torch
import torch.nn.functional as F
from comfy_env import IN_CI, REPO_ROOT
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from node_runner import execute
from reference.lycoris_factory import (
    _class_presets_restored,
    _load_snapshot,
    _randomise,
    _snapshot,
    attach,
    plain_copy,
)
from safetensors.torch import load_file, save_file
from test_nodes import _tiny_sd15_path, sample

import nodes as comfy_nodes  # ComfyUI's nodes.py

loras = test_nodes.loras  # fixture

try:
    import gguf
except ImportError:
    if IN_CI:  # CI must run these tests: a missing dependency is a failure there
        raise
    pytest.skip("gguf (requirements-dev.txt) is not installed: run scripts/setup.sh", allow_module_level=True)

PACK_DIR = REPO_ROOT / ".deps" / "custom_nodes" / "ComfyUI-GGUF"
F64 = torch.float64
TYPES = ("Q8_0", "Q4_0", "F16")
MODES = ("merge", "bypass", "auto")
STRENGTH = 0.5  # linear strength mode: the truth is y_base + 0.5·(y_ref − y_base), so a wrong scale shows
TOLERANCE = 1e-4  # of the change itself: fp32 arithmetic on an exact base
# plus a few fp32 roundings of the output itself (our forward runs in fp32, as does the reference's for OFT/BOFT):
# what bounds a layer the reference barely changes (diag-OFT on the 4-channel out.2)
FP32_FLOOR = 1e-6

LOCON = {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}
ALGOS = {  # id -> (lycoris algo, kwargs, dtype the reference computes in: OFT's Cayley transform cannot run in f64)
    "locon": ("lora", LOCON, F64),
    "loha": ("loha", LOCON, F64),
    "lokr": ("lokr", {"linear_dim": 2, "linear_alpha": 1.5, "conv_dim": 2, "conv_alpha": 1.0}, F64),
    "glora": ("glora", LOCON, F64),
    "locon_dora": ("lora", dict(LOCON, dora_wd=True, wd_on_output=True), F64),
    "oft": ("diag-oft", {"linear_dim": 4, "conv_dim": 4}, torch.float32),
    "boft": ("boft", {"linear_dim": 16, "conv_dim": 16}, torch.float32),  # factor 16: 4, 320, 1280 and 2560 fit
    "ia3": ("ia3", {}, F64),
    "full": ("full", {}, F64),
}


# ----------------------------------------------------------------------------------------------- the real pack

@functools.cache
def _load_pack():
    """The pack as ComfyUI loads a custom node folder (its module, NODE_CLASS_MAPPINGS registered in nodes.py)."""
    loaded = asyncio.run(comfy_nodes.load_custom_node(str(PACK_DIR)))  # async on 0.3.75 and 0.33
    assert loaded, f"ComfyUI could not load {PACK_DIR} as a custom node (see the log)"
    return comfy_nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]


def gguf_pack():
    """UnetLoaderGGUF from the real pack; without the unpacked pack the GGUF tests skip (fail under CI)."""
    if not (PACK_DIR / "__init__.py").is_file():
        why = (f"ComfyUI-GGUF is not unpacked at {PACK_DIR}: scripts/setup.sh unpacks it from "
               "../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz")
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)
    return _load_pack()


def _convert_module():
    spec = importlib.util.spec_from_file_location("comfyui_gguf_convert", PACK_DIR / "tools" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(writer, path) -> None:
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def convert_to_f16(checkpoint, path) -> None:
    """tools/convert.py's convert_file, with the architecture named (its detection needs input_blocks.3.0.op)."""
    convert = _convert_module()
    state_dict = convert.load_state_dict(str(checkpoint))  # the UNet, prefix stripped, as convert.py reads it
    arch = convert.ModelSD1()
    writer = gguf.GGUFWriter(path=None, arch=arch.arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # a line per tensor
        convert.handle_tensors(writer, state_dict, arch)
    _write(writer, path)


def requantize(source, path, qtype_name: str, quantizes=lambda name, data: True) -> None:
    """Every multi-dimensional F16 tensor of `source` (that `quantizes` accepts) re-quantized to `qtype_name` by
    gguf-py (1-D tensors stay F16, as llama.cpp's quantizer keeps them); convert.py's reshape metadata is carried
    over."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(path=None, arch=reader.get_field("general.architecture").contents())
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype_name}"])
    for name, reader_field in reader.fields.items():
        if name.startswith("comfy.gguf.orig_shape."):
            writer.add_array(name, reader_field.contents())
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for tensor in reader.tensors:
        data = tensor.data
        if data.ndim > 1 and data.shape[-1] % block == 0 and quantizes(tensor.name, data):
            writer.add_tensor(tensor.name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    _write(writer, path)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """{type: MODEL from UnetLoaderGGUF} for F16, Q8_0 and Q4_0 GGUF files of the tiny SD1.5 UNet."""
    loader = gguf_pack()
    folder = tmp_path_factory.mktemp("gguf_unets")
    convert_to_f16(_tiny_sd15_path(), folder / "tiny-F16.gguf")
    for qtype in ("Q8_0", "Q4_0"):
        requantize(folder / "tiny-F16.gguf", folder / f"tiny-{qtype}.gguf", qtype)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("diffusion_models", "unet_gguf"):
            mp.setitem(folder_paths.folder_names_and_paths, key, ([str(folder)], {".gguf"}))
        mp.setattr(folder_paths, "filename_list_cache", {})
        # a V1 node: the executor calls a fresh instance, which returns its outputs as a tuple
        models = {t: execute(loader(), unet_name=f"tiny-{t}.gguf")[0] for t in TYPES}
    yield models
    comfy.model_management.unload_all_models()


# The layers the files patch: one of every kind and shape class of the UNet (the whole UNet's 69 would triple the
# table's time and add no kind).
ATTN = "input_blocks.1.1.transformer_blocks.0"
LAYERS = ("input_blocks.0.0",  # conv 3×3, 4 -> 320 (packed rows of 256 with convert.py's reshape)
          "input_blocks.1.0.in_layers.2",  # conv 3×3, 320 -> 320
          "input_blocks.1.0.emb_layers.1",  # Linear 1280 -> 320
          "input_blocks.1.1.proj_in",  # conv 1×1
          f"{ATTN}.attn1.to_q",  # Linear 320 -> 320, no bias
          f"{ATTN}.attn1.to_out.0",  # Linear with a bias
          f"{ATTN}.attn2.to_k",  # Linear 768 -> 320 (rows of 768: not reshaped)
          f"{ATTN}.ff.net.0.proj",  # Linear 320 -> 2560
          f"{ATTN}.ff.net.2",  # Linear 1280 -> 320
          "output_blocks.0.0.skip_connection",  # conv 1×1, 640 -> 320
          "time_embed.0",  # Linear 320 -> 1280
          "out.2")  # conv 3×3, 320 -> 4


def all_layers(model) -> dict[str, torch.nn.Module]:
    unet = model.model.diffusion_model
    return {name: m for name, m in unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}


def layers_of(model) -> dict[str, torch.nn.Module]:
    """The layers the files patch, by path."""
    unet = model.model.diffusion_model
    return {path: unet.get_submodule(path) for path in LAYERS}


def decoder(layer):
    """The pack's own dequantize_tensor (ops.py imports it from dequant.py)."""
    import sys

    return sys.modules[type(layer).__module__].dequantize_tensor


def dequantized(layer, tensor) -> torch.Tensor | None:
    """A GGUF tensor decoded by the pack, as its forward decodes it, in float64."""
    if tensor is None:
        return None
    return decoder(layer)(tensor, torch.float32, layer.dequant_dtype).to(F64)


def test_the_files_hold_what_their_names_say(gguf_models):
    """Setup check: the layers are the pack's, their weights stored in the file's type. The pack loads an F16
    conv weight into the layer's own float tensor (torch's loading; fp32 here), every other weight as a
    GGMLTensor."""
    for qtype, model in gguf_models.items():
        layers = all_layers(model)
        assert len(layers) == 69 and set(LAYERS) <= set(layers)
        for name, layer in layers.items():
            assert type(layer).__name__ in ("Linear", "Conv2d") and hasattr(layer, "get_weight"), name
            if qtype == "F16" and isinstance(layer, torch.nn.Conv2d):
                assert type(layer.weight) is torch.nn.Parameter and layer.weight.is_floating_point(), name
            else:
                assert layer.weight.tensor_type.name == qtype, (name, layer.weight.tensor_type.name)
            assert layer.is_ggml_quantized() == (qtype != "F16")


# ------------------------------------------------------------------------------------------- reference files

def _root(model, dtype):
    """float copies of the model's layers holding its dequantized weights, under `unet.<path>` (the names the saved
    file's modules get, renamed to kohya's lora_unet_* below)."""
    root = torch.nn.Module()
    copies = {}
    for path, layer in layers_of(model).items():
        copy = plain_copy(layer, dequantized(layer, layer.weight), dequantized(layer, layer.bias), dtype)
        attach(root, f"unet.{path}", copy)
        copies[path] = copy
    return root, copies


def _network(algo_id: str, root, paths):
    algo, kwargs, dtype = ALGOS[algo_id]
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [],
                                     "name_algo_map": {re.escape(f"unet.{p}") + "$": {} for p in paths}})
        net = create_lycoris(root, 1.0, warn_on_unmatched=False, algo=algo, **kwargs)
    assert len(net.loras) == len(paths), (algo_id, len(net.loras), len(paths))
    for module in net.loras:
        module.to(dtype)
    return net


def probe(layer, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if isinstance(layer, torch.nn.Linear):
        return torch.randn(6, layer.in_features, generator=gen).double()
    return torch.randn(1, layer.in_channels, 6, 6, generator=gen).double()


@dataclass
class ReferenceFile:
    algo_id: str
    path: str
    snapshot: list = field(repr=False)
    truths: dict = field(default_factory=dict, repr=False)  # qtype -> {layer path: (x, y_base, y_ref)}


def _make_file(algo_id: str, model, directory) -> ReferenceFile:
    _algo, _kwargs, dtype = ALGOS[algo_id]
    root, copies = _root(model, dtype)
    net = _network(algo_id, root, list(copies))
    _randomise(net, torch.Generator().manual_seed(20261124 + sum(map(ord, algo_id))))
    snapshot = _snapshot(net)
    net.apply_to()
    raw = directory / f"{algo_id}.raw.safetensors"
    net.save_weights(str(raw), torch.float32, {})
    renamed = {k.replace("lycoris_unet_", "lora_unet_", 1): v for k, v in load_file(str(raw)).items()}
    path = directory / f"gguf_{algo_id}.safetensors"
    save_file(renamed, str(path))
    return ReferenceFile(algo_id, str(path), snapshot)


@torch.no_grad()
def truth(ref: ReferenceFile, model, qtype: str) -> dict:
    """{layer path: (x, y_base, y_ref(1))}: the reference network, with the file's values, on copies of this model's
    dequantized layers; x a seeded input per layer."""
    if qtype not in ref.truths:
        _algo, _kwargs, dtype = ALGOS[ref.algo_id]
        root, copies = _root(model, dtype)
        bases = {path: (copy.weight.detach().clone(), None if copy.bias is None else copy.bias.detach().clone())
                 for path, copy in copies.items()}
        net = _network(ref.algo_id, root, list(copies))
        _load_snapshot(net, ref.snapshot)
        net.apply_to()
        out = {}
        for i, (path, copy) in enumerate(copies.items()):
            x = probe(copy, 1000 + i)
            w, b = bases[path]
            base = (F.linear(x, w.double(), None if b is None else b.double()) if isinstance(copy, torch.nn.Linear)
                    else F.conv2d(x, w.double(), None if b is None else b.double(), copy.stride, copy.padding))
            out[path] = (x, base, copy(x.to(dtype)).double())
        ref.truths[qtype] = out
    return ref.truths[qtype]


@pytest.fixture(scope="module")
def reference(gguf_models, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf_reference")
    made = {}

    def get(algo_id):
        if algo_id not in made:
            made[algo_id] = _make_file(algo_id, gguf_models["F16"], directory)
        return made[algo_id]
    return get


def install(ref: ReferenceFile, folder) -> str:
    name = os.path.basename(ref.path)
    shutil.copy(ref.path, folder / name)
    return name


def run_loader(model, name: str, mode: str, uid: str = "51"):
    out = execute(LycorisLoaderModelOnly, uid, model=model, lycoris_name=name, strength_model=STRENGTH,
                  strength_mode="linear", apply_mode=mode)
    return out.result[0], json.loads(json.dumps(out.ui["lycoris"][0]))


# ----------------------------------------------------------------------------------------------------- the table

def _expected_bypassed(qtype: str, mode: str) -> bool:
    """Bypass runs every Linear/Conv change in the forward; auto and merge never on GGUF: the pack applies merged
    patches to the decoded weight at every forward (nothing is re-quantized, so a merge is exact there, and cheaper
    than bypass for changes that read W, bench/results-quantized-*.md), and F16 GGUF weights are plain fp16 data."""
    return mode == "bypass"


@pytest.mark.parametrize("algo_id", list(ALGOS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qtype", TYPES)
@torch.no_grad()
def test_gguf_table(qtype, mode, algo_id, gguf_models, reference, loras):
    """Every layer's forward, as ComfyUI runs the loaded GGUF model, equals the reference's on the dequantized
    weights: within 1e-4 of the change; where a merge writes W' into an F16 weight, W' is the truth rounded to
    fp16. Every module applies, and the report says how many ran in bypass."""
    model = gguf_models[qtype]
    ref = reference(algo_id)
    patched, data = run_loader(model, install(ref, loras), mode)
    assert (data["applied"], data["problems"]) == (data["total"], []), data["line"]
    layers = layers_of(model)
    bypassed = _expected_bypassed(qtype, mode)
    assert data["bypassed"] == (len(layers) if bypassed else 0), data["line"]
    formats = {f"GGUF {qtype}": len(layers)} if bypassed and qtype != "F16" else {}
    assert data["bypassed_formats"] == formats, data["line"]
    if formats:
        assert data["line"].endswith(f" in bypass; GGUF {qtype}: {len(layers)} bypassed)"), data["line"]
    # a merge into GGUF weights runs at every forward on the decoded weight: nothing is re-rounded, no warning
    assert not any("re-rounds" in w for w in data["warnings"]), data["warnings"]
    truths = truth(ref, model, qtype)
    comfy.model_management.load_models_gpu([patched])
    changed, worst = 0, 0.0
    for path, layer in layers.items():
        x, y_base, y_ref = truths[path]
        want = y_base + STRENGTH * (y_ref - y_base)
        change = float((want - y_base).norm())
        changed += change > 1e-3 * float(y_base.norm())
        got = layer(x.float()).double()
        what = f"{qtype} {mode} {algo_id} {path}"
        if layer.weight.dtype == torch.float16 and not _expected_bypassed(qtype, mode):
            _assert_f16_merge(layer, x, got, want, what)
        else:
            error = float((got - want).norm())
            allowed = TOLERANCE * change + FP32_FLOOR * float(y_base.norm())
            assert error <= allowed, f"{what}: off by {error / change:.2e} of the change (allowed {allowed:.2e})"
            if change > 1e-3 * float(y_base.norm()):
                worst = max(worst, error / change)
    print(f"GGUF {qtype} {mode} {algo_id}: worst exact-checked layer off by {worst:.1e} of its change")  # -s: README
    assert changed >= len(layers) - 1, f"the reference changes only {changed} layers noticeably"
    comfy.model_management.unload_all_models()


def _op(layer, x, weight, bias=None):
    """The layer's op (Linear, or its conv geometry) with the given parameters."""
    if isinstance(layer, torch.nn.Linear):
        return F.linear(x, weight, bias)
    return F.conv2d(x, weight, bias, layer.stride, layer.padding)


def _assert_f16_merge(layer, x, got, want, what) -> None:
    """A merge into an F16 weight stores W' rounded to fp16, as on any fp16 model: every output is within what
    rounding the stored weight and bias (half an fp16 step each, relative 2^-11) can move it, and no further."""
    weight = layer.weight.detach().as_subclass(torch.Tensor)
    assert weight.dtype == torch.float16, f"{what}: merged weight stored as {weight.dtype}"
    half_step = lambda t: t.double().abs() * 2.0 ** -11 + 2.0 ** -25
    bias = None if layer.bias is None else half_step(layer.bias.detach().as_subclass(torch.Tensor))
    bound = _op(layer, x.abs(), half_step(weight), bias) + 1e-5 * float(want.abs().max())
    excess = float(((got - want).abs() - bound).max())
    assert excess <= 0, f"{what}: beyond fp16 rounding of W' by {excess:.3g}"


# ---------------------------------------------------------------------------------------------- the report

def test_report_measures_the_decoded_weight(gguf_models, reference, loras):
    """The panel's ‖ΔW‖/‖W‖ reads W as the pack decodes it, without the patches the pack attached to it: on
    time_embed.0 (a block of one layer) it equals ‖0.5·up·down·α/r‖ / ‖W‖ from the file and the pack's decoder, in float64."""
    model = gguf_models["Q4_0"]
    ref = reference("locon")
    patched, data = run_loader(model, install(ref, loras), "merge")
    comfy.model_management.load_models_gpu([patched])  # GGUFModelPatcher attaches the merged patches to W
    layer = model.model.diffusion_model.get_submodule("time_embed.0")
    assert layer.weight.patches, "the pack attached no patches: nothing here tests that they are ignored"
    from lycoris_nodes.nodes.glue.apply import map_file
    from lycoris_nodes.nodes.glue.cache import load_cached
    from lycoris_nodes.nodes.glue.report import _weight_fp32

    _patches, report = map_file(load_cached(str(loras / os.path.basename(ref.path))), patched, None, False)
    for applied in report.targets.values():
        target = model.model.diffusion_model.get_submodule(applied.target.key.removeprefix("diffusion_model.")
                                                             .removesuffix(".weight"))
        assert torch.equal(_weight_fp32(patched, applied), dequantized(target, target.weight).float())
    sd = load_file(ref.path)
    prefix = "lora_unet_time_embed_0"
    up, down = sd[f"{prefix}.lora_up.weight"].double(), sd[f"{prefix}.lora_down.weight"].double()
    delta = up.flatten(1) @ down.flatten(1) * float(sd[f"{prefix}.alpha"]) / down.shape[0]
    want = float((STRENGTH * delta).norm() / dequantized(layer, layer.weight).norm())
    blocks = {b["name"]: b for b in data["blocks"]}
    block = blocks["time_embed.0"]
    assert block["modules"] == 1 and block["change"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("algo_id", ["locon", "locon_dora", "glora"])
@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_gguf_offloaded(mode, algo_id, gguf_models, reference, loras):
    """The same on Q4_0 loaded in low-VRAM mode (every layer offloaded: ComfyUI's per-forward cast path; the pack
    still attaches merged patches to its weights)."""
    model = gguf_models["Q4_0"]
    ref = reference(algo_id)
    patched, data = run_loader(model, install(ref, loras), mode)
    assert data["applied"] == data["total"]
    truths = truth(ref, model, "Q4_0")
    patched.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
    try:
        assert patched.model.model_lowvram
        for path, layer in layers_of(model).items():
            x, y_base, y_ref = truths[path]
            want = y_base + STRENGTH * (y_ref - y_base)
            error, change = float((layer(x.float()).double() - want).norm()), float((want - y_base).norm())
            allowed = TOLERANCE * change + FP32_FLOOR * float(y_base.norm())
            assert error <= allowed, f"offloaded {mode} {algo_id} {path}: off by {error / change:.2e} of the change"
    finally:
        patched.unpatch_model(torch.device("cpu"))


# -------------------------------------------------------------------------------------------------- chains

def _locon_delta(ref: ReferenceFile, path: str, shape) -> torch.Tensor:
    """ΔW of a LoCon module from the file alone, in float64: up·down·α/r."""
    sd = load_file(ref.path)
    prefix = "lora_unet_" + path.replace(".", "_")
    up, down = sd[f"{prefix}.lora_up.weight"].double(), sd[f"{prefix}.lora_down.weight"].double()
    return (up.flatten(1) @ down.flatten(1) * float(sd[f"{prefix}.alpha"]) / down.shape[0]).reshape(shape)


@torch.no_grad()
def chained_truth(first: ReferenceFile, second: ReferenceFile, model) -> dict:
    """{path: (x, y_base, y)}: LoCon `first`, then the DoRA file `second` on W + 0.5·ΔW₁ (the reference network on
    copies holding that weight), both at linear strength 0.5, as chained merges define it."""
    root, copies = _root(model, F64)
    bases, after_first = {}, {}
    for path, copy in copies.items():
        bases[path] = copy.weight.detach().clone()
        copy.weight.data += STRENGTH * _locon_delta(first, path, copy.weight.shape)
        after_first[path] = copy.weight.detach().clone()
    net = _network(second.algo_id, root, list(copies))
    _load_snapshot(net, second.snapshot)
    net.apply_to()
    out = {}
    for i, (path, copy) in enumerate(copies.items()):
        x = probe(copy, 2000 + i)
        bias = None if copy.bias is None else copy.bias.detach()
        y_base, y_first = _op(copy, x, bases[path], bias), _op(copy, x, after_first[path], bias)
        out[path] = (x, y_base, y_first + STRENGTH * (copy(x) - y_first))
    return out


@pytest.mark.parametrize("first,second", [("merge", "bypass"), ("bypass", "merge"), ("bypass", "bypass"),
                                          ("merge", "merge"), ("auto", "auto")])
@torch.no_grad()
def test_a_file_that_reads_w_sees_the_file_before_it(first, second, gguf_models, reference, loras):
    """LoCon, then LoCon+DoRA (whose change reads W) on Q4_0 through two loader nodes: the DoRA file sees W plus the
    LoCon change, whether that change is attached to the GGUF weight (the pack's cast applies it when DoRA reads W)
    or runs in the forward (then DoRA runs after it in the forward, also when its own node says merge)."""
    model = gguf_models["Q4_0"]
    locon, dora = reference("locon"), reference("locon_dora")
    after_first, _ = run_loader(model, install(locon, loras), first, uid="71")
    chained, data = run_loader(after_first, install(dora, loras), second, uid="72")
    assert data["applied"] == data["total"]
    truths = chained_truth(locon, dora, model)
    comfy.model_management.load_models_gpu([chained])
    for path, layer in layers_of(model).items():
        x, y_base, want = truths[path]
        error, change = float((layer(x.float()).double() - want).norm()), float((want - y_base).norm())
        allowed = TOLERANCE * change + FP32_FLOOR * float(y_base.norm())
        assert error <= allowed, f"{first}->{second} {path}: off by {error / change:.2e} of the change"


# --------------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def conds():
    from test_nodes import encode

    _model, clip, _vae, _ = comfy.sd.load_checkpoint_guess_config(str(_tiny_sd15_path()))
    return encode(clip)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_a_gguf_model_with_the_loader(mode, gguf_models, reference, loras, conds):
    """KSampler (1 step) on the Q4_0 model with a DoRA file (reads W) in each mode: runs, and the file changes the
    sample."""
    model = gguf_models["Q4_0"]
    patched, data = run_loader(model, install(reference("locon_dora"), loras), mode)
    assert data["applied"] == data["total"]
    plain = sample(model, conds)
    changed = sample(patched, conds)
    assert not torch.equal(plain, changed)
