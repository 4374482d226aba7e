"""What the coverage line and the report say about quantized layers (issue #15), on ComfyUI's own quantized formats:
which layers were bypassed, per storage format, and the one warning a merge into quantized weights gets.

The model is the tiny SD1.5 UNet loaded by ComfyUI with fp8 e4m3fn weights (its `dtype` model option, what the
UNET loader's weight_dtype does), with three attention projections swapped for ComfyUI's other quantized layers:
a `comfy_quant` QuantizedTensor (fp8), a scaled-fp8 Linear as each ComfyUI loads one, and on 0.33 an INT8
tensorwise and an mxfp8 layer. GGUF layers are covered in test_gguf.py.
"""

import json

import comfy.model_management
import comfy.ops
import comfy.quant_ops
import comfy.sd
import comfy.utils
import pytest
import test_nodes
import torch
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from node_runner import execute
from patcher_util import comfy_quant_linear, quantized_linear, scaled_fp8_linear
from test_nodes import PROJ_IN, TO_Q, _tiny_sd15_path, lora, write

loras = test_nodes.loras  # fixture

FP8 = torch.float8_e4m3fn
# 0.33's comfy_quant formats beyond fp8 (0.3.75 has fp8 layouts only)
QUANT_ALGOS = getattr(comfy.quant_ops, "QUANT_ALGOS", {})
HAS_INT8, HAS_MXFP8 = "int8_tensorwise" in QUANT_ALGOS, "mxfp8" in QUANT_ALGOS
ATTN = "input_blocks.1.1.transformer_blocks.0.attn1"
TO_K, TO_V, TO_OUT = (f"lora_unet_{ATTN.replace('.', '_')}_{n}" for n in ("to_k", "to_v", "to_out_0"))


def _swap(unet, path: str, make) -> None:
    parent, name = path.rsplit(".", 1)
    old = unet.get_submodule(path)
    unet.get_submodule(parent).add_module(name, make(old.weight.float(), None if old.bias is None else
                                                     old.bias.float()))


@pytest.fixture(scope="module")
def quantized_unet():
    """(MODEL, {layer path: format the report must name})."""
    sd = comfy.utils.load_torch_file(str(_tiny_sd15_path()))
    unet_sd = {k: v for k, v in sd.items() if k.startswith("model.diffusion_model.")}
    model = comfy.sd.load_diffusion_model_state_dict(unet_sd, model_options={"dtype": FP8})
    unet = model.model.diffusion_model
    _swap(unet, f"{ATTN}.to_q", lambda w, b: quantized_linear(w, b, FP8))
    _swap(unet, f"{ATTN}.to_k", lambda w, b: scaled_fp8_linear(w, b, FP8, 1.0))
    formats = {f"{ATTN}.to_q": "fp8 e4m3fn", f"{ATTN}.to_k": "fp8 e4m3fn", f"{ATTN}.to_out.0": "fp8 e4m3fn",
               "input_blocks.1.1.proj_in": "fp8 e4m3fn"}
    for path, fmt, name, present in ((f"{ATTN}.to_v", "int8_tensorwise", "int8", HAS_INT8),
                                     (f"{ATTN}.to_out.0", "mxfp8", "mxfp8", HAS_MXFP8)):
        if present:
            _swap(unet, path, lambda w, b, fmt=fmt: comfy_quant_linear(w, torch.zeros(w.shape[0]) if b is None else b,
                                                                       fmt))
            formats[path] = name
        else:  # 0.3.75 has fp8 layouts only: the layer stays plain fp8
            assert not hasattr(comfy.quant_ops, "TensorWiseINT8Layout")
            formats[path] = "fp8 e4m3fn"
    yield model, formats
    comfy.model_management.unload_all_models()


def _file(loras) -> str:
    sd = {}
    for i, prefix in enumerate((TO_Q, TO_K, TO_V, TO_OUT)):
        sd.update(lora(prefix, 320, 320, seed=10 * i))
    sd.update(lora(PROJ_IN, 320, 320, seed=50, kernel=(1, 1)))
    return write(loras, "quantized_report.safetensors", sd)


def _expected_formats(formats: dict) -> dict:
    counts = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return counts


def _run(model, name: str, mode: str) -> dict:
    out = execute(LycorisLoaderModelOnly, "61", model=model, lycoris_name=name, strength_model=1.0,
                  apply_mode=mode)
    return json.loads(json.dumps(out.ui["lycoris"][0]))  # what the panel receives


@pytest.mark.parametrize("mode", ["auto", "bypass"])
def test_line_names_each_bypassed_storage_format(mode, quantized_unet, loras):
    model, formats = quantized_unet
    data = _run(model, _file(loras), mode)
    expected = _expected_formats(formats)
    assert data["applied"] == data["total"] == 5 and data["bypassed"] == 5, data["line"]
    assert data["bypassed_formats"] == expected
    listed = ", ".join(f"{fmt}: {n} bypassed" for fmt, n in sorted(expected.items(), key=lambda kv: (-kv[1], kv[0])))
    assert ", 5 in bypass" in data["line"] and data["line"].endswith(f"; {listed})"), data["line"]
    # 0.33 runs the int8 layer without its forward: the line says so before the formats (test_bypass_dynamic.py)
    assert ("1 of them added at the weight cast" in data["line"]) == HAS_INT8
    assert not any("re-rounds" in w for w in data["warnings"]), data["warnings"]


def test_merge_into_quantized_weights_warns_once(quantized_unet, loras):
    model, formats = quantized_unet
    data = _run(model, _file(loras), "merge")
    assert data["bypassed"] == 0 and data["bypassed_formats"] == {} and "bypass" not in data["line"]
    rounding = [w for w in data["warnings"] if "re-rounds" in w]
    assert len(rounding) == 1, data["warnings"]
    listed = ", ".join(f"{fmt} {n}" for fmt, n in sorted(_expected_formats(formats).items(), key=lambda kv: (-kv[1], kv[0])))
    assert rounding[0].startswith(f"5 patches were merged into quantized weights ({listed}): the merge re-rounds "
                                  "W+dW to the stored format, so part of the change is lost; apply_mode auto keeps "
                                  "it exact"), rounding[0]


def test_plain_float_model_gets_no_format_list_or_warning(loras):
    """fp16 weights (the tiny model as stored): merge and bypass report as before, nothing about formats."""
    model, _clip, _vae, _ = comfy.sd.load_checkpoint_guess_config(str(_tiny_sd15_path()))
    name = _file(loras)
    merged = _run(model, name, "merge")
    bypassed = _run(model, name, "bypass")
    assert not any("re-rounds" in w for w in merged["warnings"] + bypassed["warnings"])
    assert merged["bypassed_formats"] == bypassed["bypassed_formats"] == {}
    assert bypassed["line"].endswith(", 5 in bypass)"), bypassed["line"]
