"""OFT files from ComfyUI's own trainer (comfy_extras/nodes_train.py: TrainLoraNode, algorithm "OFT", saved by
SaveLoRA), applied as ComfyUI defines its OFT: the Cayley constraint is alpha itself, where LyCORIS' is alpha · out.

The file is made by ComfyUI's own nodes on the CPU: TrainLoraNode trains the tiny SD1.5 for one AdamW step at
lr 0.01 (rank 8: b = 8), then SaveLoRA writes what it returns. AdamW's first step moves every element with a gradient
by the learning rate, and B[i, j] and B[j, i] move apart, so ‖Q‖_F = 2·lr·√(n·b(b−1)): 0.95 on the 320-wide layers
(under alpha = 1: not clamped), 1.9 and 2.7 on the 1280- and 2560-wide ones (clamped). Read with LyCORIS'
constraint (C = 1 · out) nothing is clamped, and the clamped layers come out wrong.

Truth is ComfyUI's core loader applying the same file (comfy.sd.load_lora_for_models, OFTAdapter.calculate_weight;
at strength 1 its m² is 1), itself checked against the trained adapters' own forward (OFTDiff.__call__). Every
weight the core loader patches (OFT weights, `diff_b` biases, `diff` norm weights) must come out within 1e-4 of its
change in fp32, merged, and every patched layer's output in bypass mode. A file written by LyCORIS (lycoris-lora
4.1.3) with the same kind of blocks keeps LyCORIS' constraint.
"""

import asyncio
import inspect
import re
import shutil

import comfy.model_management
import comfy.sd
import comfy.utils
import execution
import folder_paths
import pytest
import test_nodes
import torch
import torch.nn.functional as F
from comfy.weight_adapter.oft import OFTAdapter
from comfy_extras import nodes_train
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.lycoris_core.patch import apply
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from node_runner import execute
from reference.lycoris_factory import _class_presets_restored, _randomise, attach, plain_copy
from safetensors import safe_open
from test_nodes import _tiny_sd15_path, weights_after_full_load

sd15, loras = test_nodes.sd15, test_nodes.loras  # fixtures

LEARNING_RATE, ALPHA = 0.01, 1.0  # see the module docstring; alpha: the 1.0 TrainLoraNode gives every OFT module
TOLERANCE = 1e-4  # of the change itself, fp32
LABEL = "OFT (ComfyUI trainer)"


@pytest.fixture(autouse=True)
def no_panel_measurement(monkeypatch):
    monkeypatch.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)


# --- the file, made by ComfyUI's trainer and saver -----------------------------------------------------------------

def run_node(cls, inputs: dict[str, list]):
    """The executor's call of a node whose inputs are lists (TrainLoraNode takes them all as lists)."""
    v3 = "v3_data" in inspect.signature(execution._async_map_node_over_list).parameters
    extra = {"v3_data": {"hidden_inputs": {}}} if v3 else {"hidden_inputs": {}}
    (output,) = asyncio.run(execution._async_map_node_over_list("train", "1", cls, inputs, cls.FUNCTION, **extra))
    return output


def train_inputs(model) -> dict[str, list]:
    """TrainLoraNode's defaults, with the OFT algorithm, one step at LEARNING_RATE, and two 8×8 latents (0.3.75
    fails on a single latent tensor: its multi_res is set only for a list)."""
    schema = nodes_train.TrainLoraNode.INPUT_TYPES()
    specs = {**schema["required"], **schema.get("optional", {})}
    inputs = {name: [spec[1]["default"]] for name, spec in specs.items() if "default" in spec[1]}
    gen = torch.Generator().manual_seed(0)
    inputs.update(model=[model], steps=[1], learning_rate=[LEARNING_RATE], algorithm=["OFT"], seed=[0],
                  latents=[{"samples": torch.randn(1, 4, 8, 8, generator=gen)} for _ in range(2)],
                  positive=[[[torch.randn(1, 77, 768, generator=gen) * 0.5, {}]]])
    assert set(inputs) == set(specs), set(specs) - set(inputs)
    return inputs


def train_and_save(folder, algorithm: str, marker: str, name: str):
    """The file SaveLoRA writes into `folder` for one TrainLoraNode step with `algorithm` (on a model of its own:
    the trainer sets train mode and wraps weights); `marker` is a key suffix the trained adapter has."""
    inputs = train_inputs(comfy.sd.load_checkpoint_guess_config(str(_tiny_sd15_path()))[0])
    inputs["algorithm"] = [algorithm]
    output = run_node(nodes_train.TrainLoraNode, inputs)
    (lora,) = [r for r in output.result if isinstance(r, dict) and any(k.endswith(marker) for k in r)]
    comfy.model_management.unload_all_models()
    with pytest.MonkeyPatch.context() as patch:  # SaveLoRA writes under ComfyUI's output folder
        patch.setattr(folder_paths, "output_directory", str(folder))
        execute(nodes_train.SaveLoRA, lora=lora, prefix=f"loras/{name}", steps=1)
    (path,) = (folder / "loras").glob(f"{name}_1_steps_*.safetensors")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_and_save(tmp_path_factory.mktemp("comfy_output"), "OFT", ".oft_blocks", "comfy_oft")


def oft_prefixes(sd) -> list[str]:
    return [k.removesuffix(".oft_blocks") for k in sd if k.endswith(".oft_blocks")]


def skew_norm(blocks: torch.Tensor) -> float:
    q = blocks.float() - blocks.float().transpose(1, 2)
    return float(q.norm())


def test_the_file_is_what_comfyuis_trainer_writes(trained):
    """No metadata; every module under ComfyUI's `diffusion_model.` name; OFT blocks with alpha 1 and no rescale;
    the clamp acts on some layers and not on others."""
    with safe_open(str(trained), "pt") as f:
        assert not f.metadata()
    sd = comfy.utils.load_torch_file(str(trained))
    assert all(k.startswith("diffusion_model.") for k in sd)
    assert {k.rsplit(".", 1)[1] for k in sd} == {"oft_blocks", "alpha", "diff_b", "diff"}
    prefixes = oft_prefixes(sd)
    assert len(prefixes) == 69 and all(float(sd[f"{p}.alpha"]) == ALPHA for p in prefixes)
    clamped = [p for p in prefixes if skew_norm(sd[f"{p}.oft_blocks"]) + 1e-8 > ALPHA]
    assert 3 <= len(clamped) <= len(prefixes) - 10, f"{len(clamped)} of {len(prefixes)} layers clamped"


def test_read_as_comfyuis_oft(sd15, trained):
    lfile = parse_state_dict(comfy.utils.load_torch_file(str(trained)), trained.name)
    oft_modules = [m for m in lfile.modules.values() if m.tensors.keys() & {"oft_blocks"}]
    assert len(oft_modules) == 69 and {m.algorithm.name for m in oft_modules} == {"comfy-oft"}
    assert lfile.unused == []
    _patches, report = map_file(lfile, sd15[0], None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    assert report.labels[LABEL] == 69
    assert summarize(trained).algorithms[LABEL] == 69


# --- truth: ComfyUI's core loader, checked against its training adapters' forward ----------------------------------

@pytest.fixture(scope="module")
def truth(sd15, trained):
    """{key: (W before, W after)} for every key ComfyUI's core loader patches."""
    model = sd15[0]
    sd = comfy.utils.load_torch_file(str(trained))
    patched, _clip = comfy.sd.load_lora_for_models(model, None, sd, 1.0, 0)
    assert len(patched.patches) == 168
    base = model.model.state_dict()
    after = weights_after_full_load(patched, list(patched.patches))
    comfy.model_management.unload_all_models()
    out = {key: (base[key].detach().clone(), after[key]) for key in patched.patches}
    for prefix in oft_prefixes(sd):  # the core loader's weight is the trained adapter's own forward
        w0, w1 = out[f"{prefix}.weight"]
        assert rel(w1, w0) > 1e-5, f"{prefix}: ComfyUI's loader did not change it"
        trained_adapter = OFTAdapter.load(prefix, sd, float(sd[f"{prefix}.alpha"]), None).to_train().float()
        assert rel(w1 - w0, trained_adapter(w0.float()).detach() - w0) < 1e-5, prefix
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lycoris_constraint_would_be_wrong(trained, truth):
    """The case this file is for: the clamped layers come out wrong when the blocks are read as LyCORIS' diag-OFT
    (the same tensors under a name LyCORIS writes), and the unclamped ones equal."""
    sd = comfy.utils.load_torch_file(str(trained))
    wrong = {}
    for prefix in oft_prefixes(sd):
        as_lycoris = {f"lycoris_x.{k.rsplit('.', 1)[1]}": sd[k] for k in (f"{prefix}.oft_blocks", f"{prefix}.alpha")}
        module = parse_state_dict(as_lycoris, "as_lycoris").modules["lycoris_x.weight"]
        assert module.algorithm.name == "diag-oft"
        w0, w1 = truth[f"{prefix}.weight"]
        got = apply(module.plan_for(tuple(w0.shape)), module.tensors, w0.clone(), 1.0)
        wrong[prefix] = rel(got - w0, w1 - w0)
    clamped = {p for p in wrong if skew_norm(sd[f"{p}.oft_blocks"]) + 1e-8 > ALPHA}
    assert all(wrong[p] > 0.1 for p in clamped) and all(wrong[p] < 1e-5 for p in set(wrong) - clamped)


# --- the loader node, merge and bypass ----------------------------------------------------------------------------

def install(trained, folder) -> str:
    shutil.copy(trained, folder / trained.name)
    return trained.name


@pytest.mark.parametrize("strength_mode", ["linear", "lycoris"])
def test_merge_equals_comfyuis_loader(sd15, loras, trained, truth, strength_mode):
    model = sd15[0]
    patched = execute(LycorisLoaderModelOnly, model=model, lycoris_name=install(trained, loras), strength_model=1.0,
                      strength_mode=strength_mode, apply_mode="merge").result[0]
    assert set(patched.patches) == set(truth)
    got = weights_after_full_load(patched, list(truth))
    for key, (w0, w1) in truth.items():
        error = float((got[key].double() - w1.double()).norm())
        change = float((w1.double() - w0.double()).norm())
        assert error <= TOLERANCE * change, f"{key}: off by {error / change:.2e} of the change"


def layer_op(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    if isinstance(layer, torch.nn.Linear):
        return F.linear(x, weight, bias)
    return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def probe(layer: torch.nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if isinstance(layer, torch.nn.Linear):
        return torch.randn(3, layer.in_features, generator=gen)
    return torch.randn(1, layer.in_channels, 6, 6, generator=gen)


@torch.no_grad()
def test_bypass_equals_comfyuis_loader(sd15, loras, trained, truth):
    """Every OFT layer's output, the layer running its bypass form, within 1e-4 of the change of ComfyUI's patched
    layer; biases and norm weights are merged in every mode, so they are compared as weights."""
    model = sd15[0]
    out = execute(LycorisLoaderModelOnly, "61", model=model, lycoris_name=install(trained, loras),
                  strength_model=1.0, strength_mode="lycoris", apply_mode="bypass")
    patched = out.result[0]
    assert out.ui["lycoris"][0]["bypassed"] == 69
    comfy.model_management.load_models_gpu([patched])
    try:
        state = patched.model.state_dict()
        layers = {key.removesuffix(".weight") for key in truth if key.endswith(".weight") and truth[key][0].ndim > 1}
        assert len(layers) == 69
        for i, name in enumerate(sorted(layers)):
            layer = patched.model.get_submodule(name)
            x = probe(layer, i)
            w0, w1 = truth[f"{name}.weight"]
            b0, b1 = truth.get(f"{name}.bias", (layer.bias, layer.bias))
            want = layer_op(layer, x.double(), w1.double(), None if b1 is None else b1.double())
            change = float((want - layer_op(layer, x.double(), w0.double(), None if b0 is None else b0.double()))
                           .norm())
            error = float((layer(x).double() - want).norm())
            assert error <= TOLERANCE * change, f"{name}: off by {error / change:.2e} of the change"
        for key, (w0, w1) in truth.items():
            if key.removesuffix(".weight") not in layers:
                change = float((w1.double() - w0.double()).norm())
                assert float((state[key].double() - w1.double()).norm()) <= TOLERANCE * change, key
    finally:
        comfy.model_management.unload_all_models()


# --- a LyCORIS file keeps LyCORIS' constraint --------------------------------------------------------------------

# diffusers' module path (what LyCORIS wraps in a diffusers UNet, as SimpleTuner trains it) -> ComfyUI's
LYCORIS_LAYERS = {
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": "input_blocks.1.1.transformer_blocks.0.attn1.to_q",
    "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj":  # Linear 320 -> 2560
        "input_blocks.1.1.transformer_blocks.0.ff.net.0.proj",
    "down_blocks.0.attentions.0.proj_in": "input_blocks.1.1.proj_in",  # Conv2d 1x1
    "down_blocks.0.resnets.0.conv1": "input_blocks.1.0.in_layers.2",  # Conv2d 3x3
}
CONSTRAINT = 1e-3  # C = 1e-3 · out (0.32 on the 320-wide layers) < ‖Q‖ ≈ 2.5: LyCORIS clamps, to far more than 1e-3


@torch.no_grad()
def test_a_lycoris_oft_file_applies_with_lycoris_constraint(sd15, loras):
    """lycoris-lora 4.1.3's diag-OFT on float copies of four of the model's layers, under their diffusers paths (file
    names `lycoris_<path>`, as SimpleTuner's LyCORIS writes them), saved by its save_weights: merged by the node,
    every layer's output equals the reference's forward, and not what ComfyUI's constraint would give."""
    model = sd15[0]
    root, copies, bases = torch.nn.Module(), {}, {}
    for path, comfy_path in LYCORIS_LAYERS.items():
        layer = model.model.diffusion_model.get_submodule(comfy_path)
        bias = None if layer.bias is None else layer.bias.detach().float()
        bases[path] = (layer.weight.detach().float().clone(), bias)
        copies[path] = plain_copy(layer, layer.weight.detach(), bias, torch.float32)
        attach(root, path, copies[path])
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [], "name_algo_map": {
            re.escape(path) + "$": {"constraint": CONSTRAINT} for path in LYCORIS_LAYERS}})
        net = create_lycoris(root, 1.0, warn_on_unmatched=False, algo="diag-oft", linear_dim=4, conv_dim=4)
    assert len(net.loras) == len(LYCORIS_LAYERS)
    _randomise(net, torch.Generator().manual_seed(7))
    net.apply_to()  # registers the modules whose tensors save_weights writes; the copies run the reference now
    net.save_weights(str(loras / "lycoris_oft.safetensors"), torch.float32, {})
    sd = comfy.utils.load_torch_file(str(loras / "lycoris_oft.safetensors"))
    lfile = cache.load_cached(str(loras / "lycoris_oft.safetensors"))
    assert {m.algorithm.name for m in lfile.modules.values()} == {"diag-oft"}
    patched = execute(LycorisLoaderModelOnly, model=model, lycoris_name="lycoris_oft.safetensors",
                      strength_model=1.0, strength_mode="lycoris", apply_mode="merge").result[0]
    got = weights_after_full_load(patched, [f"diffusion_model.{p}.weight" for p in LYCORIS_LAYERS.values()])
    for i, (path, comfy_path) in enumerate(LYCORIS_LAYERS.items()):
        layer, (w0, bias), x = copies[path], bases[path], probe(copies[path], i)

        def output(weight, layer=layer, x=x, bias=bias):
            return layer_op(layer, x.double(), weight.double(), None if bias is None else bias.double())

        want, y0 = layer(x).double(), output(w0)
        change = float((want - y0).norm())
        assert change > 1e-2 * float(y0.norm()), path
        mine = output(got[f"diffusion_model.{comfy_path}.weight"])
        assert float((mine - want).norm()) <= TOLERANCE * change, path
        comfy_reading = OFTAdapter.load("lycoris_" + path.replace(".", "_"), sd, CONSTRAINT, None).to_train()
        theirs = output(comfy_reading(w0).detach())
        assert float((theirs - want).norm()) > 0.1 * change, f"{path}: both constraints agree; the test shows nothing"
