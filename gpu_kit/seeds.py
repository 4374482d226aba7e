"""Section 1: the four failures users reported on NVIDIA GPUs, reproduced through the loader's code path.

(a) GLoRA on a bf16 Flux: "expected m1 and m2 to have the same dtype" (the bf16 weight times fp32 factors);
(b) DoRA whose dora_scale stays on the CPU while the weight is on the GPU: "Expected all tensors to be on the same
    device";
(c) the strength changed between two runs while the weights are offloaded (lowvram here; dynamic VRAM in the
    dynamic section);
(d) a LoRA on fp8 e4m3fn bases, plain and comfy_quant (QuantizedTensor), in auto, bypass and merge.

Each case first shows the failure's condition holds on this machine where it can (the naive expression raises, the
tensor sits on the other device), then applies the reference's file and judges every layer against the reference
(`truth.judge`). A dry run has no second device: (b) then runs its device path on a FakeTensor cuda:0.
"""

import json
import tempfile
from pathlib import Path

import comfy.ops
import comfy.quant_ops
import torch
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.lycoris_core.keys import DORA_SCALE
from lycoris_nodes.nodes.glue.adapter import LycorisAdapter
from lycoris_nodes.nodes.glue.apply import apply_file

from . import models, truth
from .exact import TOKENS, load_patched, make_patcher, unload
from .models import FP8
from .report import Case

CPU = torch.device("cpu")
SET = "flux"


class Scene:
    """The Flux-size layer set in one storage dtype, its reference files made on demand."""

    def __init__(self, env, directory: Path, storage=torch.bfloat16, dynamic: bool = False, quantized: bool = False):
        self.env, self.directory, self.storage = env, directory, storage
        self.specs = models.layer_specs(SET, tiny=env.dry_run)
        self.master = models.master_weights(self.specs, seed=11)
        if quantized:
            root, self.stored = quantized_set(self.specs, self.master, env.device)
        else:
            root, self.stored = models.layer_set(SET, self.specs, self.master, storage, env.device), None
        self.base = make_patcher(root, env.device, dynamic)
        compute = models.compute_dtype(storage)
        self.inputs = {s.path: models.probe_input(s, TOKENS, compute, env.device) for s in self.specs}

    def reference(self, variant_id: str) -> truth.Truth:
        variant = next(v for v in truth.variants() if v.id == variant_id)
        chosen = truth.targets(variant, self.specs)
        if self.stored is None:
            base = truth.stored_params(self.specs, self.master, self.storage, self.env.device)
        else:  # already the dequantised values
            base = truth.stored_params(self.specs, self.stored, torch.float32, self.env.device)
        return truth.make(variant, chosen, base, self.env.device, self.directory,
                          seed=truth.factory.SEED + sum(map(ord, variant_id)))

    def outputs(self, patched, t: truth.Truth, strength: float, ideal=None) -> dict:
        verdicts = {}
        with torch.no_grad():
            for path in t.full:
                spec = next(s for s in self.specs if s.path == path)
                x = self.inputs[path]
                y = patched.model.get_submodule(f"diffusion_model.{path}")(x)
                params = t.params(path, strength)
                best = (ideal or truth.ideal_output)(spec, x, params, self.storage)
                verdicts[path] = truth.judge(y, truth.true_output(spec, x, params), best,
                                             truth.true_output(spec, x, t.base[path]))
        return verdicts


def summary(case_id: str, verdicts: dict, extra: dict | None = None, detail: str = "") -> Case:
    worst = max(verdicts.values(), key=lambda v: v["ratio"])
    ok = all(v["ok"] for v in verdicts.values())
    failed = [p for p, v in verdicts.items() if not v["ok"]]
    numbers = {"layers": len(verdicts), "worst_ratio": worst["ratio"], "worst_error": worst["error"],
               "ideal_error": worst["ideal_error"], "change": min(v["change"] for v in verdicts.values()),
               "inconclusive": sum(not v["conclusive"] for v in verdicts.values()),
               **(extra or {})}
    return Case(case_id, "pass" if ok else "fail", numbers, detail if ok else f"off the truth: {failed}. {detail}")


def raises(fn, match: str) -> str:
    """The message of the failure `fn` shows (the seed's condition holds here), or what happened instead."""
    try:
        fn()
    except RuntimeError as e:
        return str(e).splitlines()[0] if match in str(e) else f"raised something else: {e}"
    return "did not raise"


# ---- (a) GLoRA on bf16 ---------------------------------------------------------------------------------------------

def glora_bf16(scene: Scene) -> list[Case]:
    t = scene.reference("glora")
    lfile = load(t.path)
    first = next(iter(t.full))
    weight = scene.base.model.get_submodule(f"diffusion_model.{first}").weight.to(scene.env.device)
    module = next(m for m in lfile.modules.values() if m.prefix == truth.PREFIX + "_" + first.replace(".", "_"))
    factor = module.tensors["a1.weight"].to(scene.env.device)  # (in, rank): W·a1 is GLoRA's first term
    historic = raises(lambda: weight @ factor, "dtype")  # the historic expression: bf16 W times an fp32 factor
    cases = []
    for load_kind in ("full", "lowvram"):
        patched, _, _ = apply_file(lfile, scene.base, None, 1.0, 0.0, False, None, "merge")
        load_patched(patched, scene.env.device, load_kind)
        try:
            verdicts = scene.outputs(patched, t, 1.0)
        finally:
            unload(patched, load_kind)
        cases.append(summary(f"a/glora-bf16/{load_kind}", verdicts, {"historic_error": historic}))
    return cases


# ---- (b) DoRA scale on the CPU -------------------------------------------------------------------------------------

def lycoris_adapters(patched) -> list[tuple[str, LycorisAdapter]]:
    return [(key if isinstance(key, str) else key[0], patch[1]) for key, patches in patched.patches.items()
            for patch in patches if isinstance(patch[1], LycorisAdapter)]


def dora_scale_elsewhere(scene: Scene) -> list[Case]:
    t = scene.reference("locon_dora_out")
    lfile = load(t.path)
    patched, _, _ = apply_file(lfile, scene.base, None, 1.0, 0.0, False, None, "merge")
    adapters = lycoris_adapters(patched)
    scales = sorted({str(a.tensors[DORA_SCALE].device) for _, a in adapters if DORA_SCALE in a.tensors})
    load_patched(patched, scene.env.device, "full")
    try:
        weight_device = str(patched.model.get_submodule(f"diffusion_model.{next(iter(t.full))}").weight.device)
        verdicts = scene.outputs(patched, t, 1.0)
    finally:
        unload(patched, "full")
    cases = [summary("b/dora-scale-on-cpu/full", verdicts, {"devices": f"dora_scale on {scales}, weight on "
                                                                        f"{weight_device}"})]
    if scene.env.dry_run:
        cases.append(fake_cuda_dora(adapters, scene))
    return cases


def fake_cuda_dora(adapters, scene: Scene) -> Case:
    """The GPU half on a FakeTensor cuda:0: the adapter (its dora_scale on the CPU) patching a cuda weight."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    key, adapter = adapters[0]
    shape = tuple(scene.base.model.state_dict()[key].shape)
    scale = adapter.tensors[DORA_SCALE]
    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.randn(shape, dtype=torch.bfloat16, device="cuda:0")
        historic = raises(lambda: weight.float() * scale.reshape(-1, *[1] * (weight.ndim - 1)), "same device")
        out = adapter.calculate_weight(weight, key, 1.0, 1.0, None, None, intermediate_dtype=torch.bfloat16)
        ok = out.device == torch.device("cuda:0") and tuple(out.shape) == shape and out.dtype == torch.bfloat16
        placed = f"{out.device} {out.dtype}"
    return Case("b/dora-scale-on-cpu/fake-cuda", "pass" if ok else "fail",
                {"historic_error": historic, "out": placed})


# ---- (c) strength change while offloaded ---------------------------------------------------------------------------

def strength_change(scene: Scene, load_kind: str, variant_id: str = "locon_dora_out") -> list[Case]:
    """Two runs at different strengths on one offloaded model, as ComfyUI runs them: the first clone detached
    without unpatching (load_models_gpu), the second loaded; then everything restored bit for bit."""
    t = scene.reference(variant_id)
    lfile = load(t.path)
    before = {k: v.detach().clone() for k, v in scene.base.model.state_dict().items()}
    cases, previous = [], None
    for run, strength in enumerate((1.0, 0.5, 1.0)):
        patched, _, _ = apply_file(lfile, scene.base, None, strength, 0.0, False, None, "merge")
        if load_kind == "dynamic":  # load_models_gpu swaps the clones itself
            load_patched(patched, scene.env.device, "dynamic")
        elif previous is None:
            load_patched(patched, scene.env.device, "lowvram")
        else:  # what load_models_gpu does in lowvram: the loaded clone detached, the new one partially loaded
            previous.detach(unpatch_all=False)
            patched.partially_load(scene.env.device, extra_memory=1)
        verdicts = scene.outputs(patched, t, strength)
        cases.append(summary(f"c/strength-change/{load_kind}/{variant_id}/run{run + 1}-m{strength}", verdicts))
        previous = patched
    if load_kind == "dynamic":
        unload(previous, "dynamic")
    else:
        previous.detach(unpatch_all=True)
    after = scene.base.model.state_dict()
    restored = all(torch.equal(before[k].view(torch.uint8) if before[k].dtype == FP8 else before[k],
                               after[k].to(before[k].device).view(torch.uint8) if before[k].dtype == FP8
                               else after[k].to(before[k].device)) for k in before)
    cases.append(Case(f"c/strength-change/{load_kind}/{variant_id}/restored", "pass" if restored else "fail",
                      detail="" if restored else "weights differ from before the first run"))
    return cases


# ---- (d) fp8 bases -------------------------------------------------------------------------------------------------

FORMAT = "float8_e4m3fn"


class QuantConfig:
    """What pick_operations reads of a checkpoint's model config: its per-layer comfy_quant formats."""

    def __init__(self, layers: dict):
        self.quant_config = self.layer_quant_config = layers


def quantized_linear(spec, weight: torch.Tensor, bias: torch.Tensor, device) -> torch.nn.Module:
    """One Linear as ComfyUI 0.33 loads it from a comfy_quant fp8 checkpoint: the ops pick_operations chooses for
    that checkpoint on this device (native fp8 matmuls where the GPU has them, emulated otherwise), the weight
    quantized by comfy-kitchen's own quantizer."""
    layout = comfy.quant_ops.QUANT_ALGOS[FORMAT]["comfy_tensor_layout"]
    q = QuantizedTensor.from_float(weight.to(torch.bfloat16), layout)
    ops = comfy.ops.pick_operations(FP8, torch.bfloat16, load_device=device,
                                    model_config=QuantConfig({"layer": {"format": FORMAT}}))
    holder = torch.nn.Module()
    holder.add_module("layer", ops.Linear(*spec.args, bias=True))
    holder.load_state_dict({"layer.weight": q._qdata, "layer.bias": bias.to(torch.bfloat16),
                            "layer.weight_scale": q._params.scale,
                            "layer.comfy_quant": torch.tensor(list(json.dumps({"format": FORMAT}).encode()),
                                                              dtype=torch.uint8)}, strict=True)
    return holder.layer.requires_grad_(False)


def quantized_set(specs, master, device):
    """The Flux set's Linear layers as a comfy_quant fp8 checkpoint loads; returns it and the values it holds
    (dequantised, float32): the 'stored parameters' the reference starts from."""
    root = torch.nn.Module()
    root.add_module("diffusion_model", torch.nn.Module())
    values = {}
    for spec in specs:
        params = master[spec.path]
        layer = quantized_linear(spec, params["weight"], params["bias"], device)
        truth.factory.attach(root.diffusion_model, spec.path, layer)
        values[spec.path] = {"weight": layer.weight.dequantize().float(), "bias": layer.bias.float()}
    root.model_config = models.SETS[SET][1](False)
    return root.requires_grad_(False), values


def quantized_ideal(spec, x, params, storage):
    """The true parameters quantized once into the same format and run by the same ComfyUI layer (with a native
    fp8 matmul the activations are rounded too, for the ideal as for the model)."""
    layer = quantized_linear(spec, params["weight"].float(), params["bias"].float(), x.device)
    layer.comfy_cast_weights = True  # its weights stay on the CPU and are cast to x's device, as when offloaded
    with torch.no_grad():
        return layer(x)


def fp8_bases(scene: Scene, label: str) -> list[Case]:
    t = scene.reference("locon")
    lfile = load(t.path)
    ideal = quantized_ideal if scene.stored is not None else None
    cases = []
    for mode in ("auto", "bypass", "merge"):
        for load_kind in ("full", "lowvram"):
            patched, _, report = apply_file(lfile, scene.base, None, 1.0, 0.0, False, None, mode)
            load_patched(patched, scene.env.device, load_kind)
            try:
                verdicts = scene.outputs(patched, t, 1.0, ideal)
            finally:
                unload(patched, load_kind)
            cases.append(summary(f"d/{label}/{mode}/{load_kind}", verdicts, {"bypassed": report.bypassed}))
    return cases


def run(env, clock) -> list[Case]:
    steps = [
        ("a", lambda d: glora_bf16(Scene(env, d, torch.bfloat16))),
        ("b", lambda d: dora_scale_elsewhere(Scene(env, d, torch.bfloat16))),
        ("c", lambda d: strength_change(Scene(env, d, torch.bfloat16), "lowvram")),
        ("c", lambda d: strength_change(Scene(env, d, torch.bfloat16), "lowvram", "loha")),
        ("d", lambda d: fp8_bases(Scene(env, d, FP8), "fp8-e4m3fn")),
        ("d", lambda d: fp8_bases(Scene(env, d, FP8, quantized=True), "comfy-quant-fp8")),
    ]
    return run_steps(env, clock, steps)


def run_dynamic(env, clock) -> list[Case]:
    steps = [("c", lambda d: strength_change(Scene(env, d, torch.bfloat16, dynamic=True), "dynamic")),
             ("c", lambda d: strength_change(Scene(env, d, torch.bfloat16, dynamic=True), "dynamic", "loha"))]
    return run_steps(env, clock, steps)


def run_steps(env, clock, steps) -> list[Case]:
    cases = []
    with tempfile.TemporaryDirectory(dir=env.work) as tmp:
        for name, step in steps:
            if clock.out():
                cases.append(Case(f"{name}/...", "not-run", detail="time budget spent"))
                continue
            try:
                cases += step(Path(tmp))
            except Exception as e:  # noqa: BLE001 - a scenario's crash is its failure, reported with the traceback
                cases.append(Case(f"{name}/crashed", "error", detail=f"{type(e).__name__}: {e}", trace=True))
    return cases
