"""LightX2V's Wan distill LoRAs (`diff_m` on each block's `modulation`, `.diff`, `.diff_b`, LoRA factors), full
differences of any parameter ComfyUI's key map lists, and ComfyUI 0.38's `<module>.config` entries.

The model is ComfyUI's own WAN21_T2V at a tiny width (tests/test_video_dit_peft.py `comfy_model`), fp32 on the CPU.
The file is written the way LightX2V's extractor writes one (ModelTC/LightX2V tools/extract/lora_extractor.py, read
at f8aee98): `extract_lora_from_diff` keeps a weight's change as a LoRA of the original checkpoint's key
(`_decompose_to_lora`: `diffusion_model.<key without .weight>.lora_up.weight` / `.lora_down.weight`, no alpha) when
it is a 2-D weight of at least 1M parameters, else as a full difference named by `_generate_lora_diff_key`:
`.weight` -> `.diff`, `.bias` -> `.diff_b`, `.modulation` -> `.diff_m`, all under `diffusion_model.`; it saves bf16
(`save_lora_weights`, --output-dtype bf16). At 14B every attention and feed-forward weight of a block is past 1M
parameters, and `head.head` (64 × 5120) and the patch embedding (a Conv3d) are not, so the file has LoRAs on the
blocks' Linear weights and full differences everywhere else; ComfyUI keeps Wan's original names.

Truth is LightX2V's own loader (lightx2v/utils/lora_loader.py `LoRALoader.apply_lora`): a pair adds
up @ down · (alpha / rank if an alpha is given, else 1) · strength, a difference adds diff · strength, computed here
in float64 from the file's tensors. Every module applies through the loader node (no problems, no unused keys) in
merge, bypass and auto at strengths 1 and 0.5, with block weights; every parameter is W + s·Δ within 1e-4 of its
change (fp32), every other one is untouched; in bypass the Linear/Conv changes run in the forward (their weights stay
as they were and the model's output equals the one with the true weights) while the modulation, norms and biases,
which have no such forward, are merged. ComfyUI's own loading never patches a parameter of a module with children
(ModelPatcher._load_list), which the modulation is: it is set as an object patch (nodes/glue/object_params.py), and
LyCORIS Save and Convert write it back as the parameter's `.diff`.

ComfyUI 0.38's `<module>.config` entries (comfy/lora.py `load_lora`, ModelPatcher.add_patches,
comfy/configurable.py `ConfigurableModule.with_config`: UTF-8 JSON in a uint8 tensor) are read and reported as a
note, never as unused keys; a malformed one is an unused key whose reason names what is wrong.
"""

import json

import comfy.model_management
import comfy.model_patcher
import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.lycoris_file import parse_state_dict
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.lycoris_core.tools.combine import Entry, exact_module
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.tools.convert import ERROR, conversion
from lycoris_nodes.nodes.tools.save import Settings, save
from safetensors.torch import load_file
from test_nodes import run_node, weights_after_full_load, write
from test_video_dit_peft import ARCHS, comfy_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths

CPU = torch.device("cpu")
PREFIX = "diffusion_model."
RANK = 4
TOLERANCE = 1e-4  # of each parameter's largest change
MODES = ("merge", "bypass", "auto")
STRENGTHS = (1.0, 0.5)

loras = test_nodes.loras


@pytest.fixture(scope="module")
def wan():
    """(patcher, the fp32 state dict as loaded) of ComfyUI's tiny Wan 2.1 T2V."""
    model = comfy_model(ARCHS["wan21-t2v"])
    base = {k: v.detach().clone() for k, v in model.diffusion_model.state_dict().items()}
    yield comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU), base
    comfy.model_management.unload_all_models()


def is_lora(key: str, value: torch.Tensor) -> bool:
    """Where LightX2V's extractor writes a LoRA on the 14B model: 2-D weights of at least 1M parameters, i.e. a
    block's attention and feed-forward projections (5120 wide); `head.head` is 64 × 5120."""
    return value.ndim == 2 and key.startswith("blocks.") and key.endswith(".weight")


def diff_key(key: str) -> str:
    """lora_extractor.py `_generate_lora_diff_key`."""
    for written, suffix in ((".weight", ".diff"), (".bias", ".diff_b"), (".modulation", ".diff_m")):
        if key.endswith(written):
            return PREFIX + key[: -len(written)] + suffix
    raise AssertionError(f"LightX2V skips {key}")


def lightx2v_file(base: dict[str, torch.Tensor], seed: int = 7) -> dict[str, torch.Tensor]:
    """Every parameter of the model changed, written as `extract_lora_from_diff` writes it (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, value in base.items():
        if is_lora(key, value):
            up = torch.randn(value.shape[0], RANK, generator=gen) * 0.2
            down = torch.randn(RANK, value.shape[1], generator=gen) * 0.2
            stem = PREFIX + key[: -len(".weight")]
            sd[f"{stem}.lora_up.weight"], sd[f"{stem}.lora_down.weight"] = up, down
        else:
            sd[diff_key(key)] = torch.randn(value.shape, generator=gen) * 0.05
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def changes(sd: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model key -> the change at strength 1, as LightX2V's `apply_lora` adds it (no alpha: scale 1), float64."""
    out = {}
    for key in base:
        stem = PREFIX + key[: -len(".weight")] if key.endswith(".weight") else None
        if stem and f"{stem}.lora_up.weight" in sd:
            out[key] = sd[f"{stem}.lora_up.weight"].double() @ sd[f"{stem}.lora_down.weight"].double()
        elif (name := diff_key(key)) in sd:
            out[key] = sd[name].double()
    return out


def model_keys(base) -> list[str]:
    return [PREFIX + k for k in base]


def is_forward_layer(key: str) -> bool:
    """Weights of Linear/Conv layers: what bypass mode runs in the forward instead of merging."""
    return key.endswith(".weight") and not key.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight"))


def check_weights(got: dict, base: dict, delta: dict, strength_of, unmerged=frozenset()) -> None:
    """Each parameter W + s·Δ (s = strength_of(key)) within TOLERANCE of its change; `unmerged` ones unchanged."""
    for key, value in base.items():
        now = got[PREFIX + key]
        if key not in delta or key in unmerged:
            assert torch.equal(now, value), f"{key} changed"
            continue
        change = strength_of(key) * delta[key]
        assert change.abs().max() > 0, key
        error = (now.double() - (value.double() + change)).abs().max()
        assert error <= TOLERANCE * change.abs().max(), f"{key}: {error:.3g}"


def forward(patcher, transformer_options: dict | None = None) -> torch.Tensor:
    """One evaluation of the loaded model (bypass entries run in it)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 1, 4, 4, generator=gen)
    context = torch.randn(1, 5, patcher.model.diffusion_model.text_embedding[0].in_features, generator=gen)
    with torch.inference_mode():
        return patcher.model.apply_model(x, torch.tensor([0.5]), c_crossattn=context,
                                         transformer_options=transformer_options or {}).clone()


def forward_with(patcher, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unpatched model's output with `state` as its parameters (put back after)."""
    module = patcher.model.diffusion_model
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    module.load_state_dict(state)
    try:
        return forward(patcher)
    finally:
        module.load_state_dict(saved)


def applied_fully(folder, name, patcher):
    _, report = map_file(read(folder / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == [], (report.problems, report.unused_keys)
    assert len(report.applied) == report.total > 0
    return report


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strength", STRENGTHS)
def test_lightx2v_file_applies_fully_and_exactly(mode, strength, wan, loras):
    patcher, base = wan
    sd = lightx2v_file(base)
    name = write(loras, "wan_distill_lightx2v.safetensors", sd)
    report = applied_fully(loras, name, patcher)
    assert report.warnings == []  # no alpha: scale 1 is LightX2V's definition, no assumption
    assert report.labels["Full (modulation)"] == 2 + 1  # two blocks and the head
    assert report.applied["diffusion_model.blocks.0.modulation"] == "diffusion_model.blocks.0.modulation"
    delta = changes(sd, base)
    assert set(delta) == set(base)  # every parameter is in the file
    patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength,
                       apply_mode=mode)[0]
    bypassed = {k for k in base if is_forward_layer(k)} if mode == "bypass" else set()
    got = weights_after_full_load(patched, model_keys(base))
    check_weights(got, base, delta, lambda key: strength, unmerged=bypassed)
    if mode == "bypass":  # the bypassed changes are in the forward: the output is the true weights' output
        patched.patch_model(device_to=CPU, lowvram_model_memory=0)
        try:
            out = forward(patched)
        finally:
            patched.unpatch_model(CPU)
        truth = forward_with(patcher, {k: (v.double() + strength * delta[k]).float() for k, v in base.items()})
        plain = forward_with(patcher, base)
        assert (out - truth).abs().max() <= TOLERANCE * (truth - plain).abs().max()
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("mode", ("merge", "bypass"))
def test_block_weights_scale_the_modulation_with_its_block(mode, wan, loras):
    patcher, base = wan
    sd = lightx2v_file(base)
    name = write(loras, "wan_distill_lightx2v.safetensors", sd)
    patched = run_node(LycorisBlockWeights, model=patcher, clip=None, lycoris_name=name, strength_model=1.0,
                       strength_clip=1.0, block_weights="blocks.0=0.5\nhead=0", apply_mode=mode)[0]
    bypassed = {k for k in base if is_forward_layer(k)} if mode == "bypass" else set()
    unchanged = {k for k in base if k.startswith("head.")}
    got = weights_after_full_load(patched, model_keys(base))
    check_weights(got, base, {k: v for k, v in changes(sd, base).items() if k not in unchanged},
                  lambda key: 0.5 if key.startswith("blocks.0.") else 1.0, unmerged=bypassed)
    comfy.model_management.unload_all_models()


def test_diff_on_a_parameter_s_own_name_applies(wan, loras):
    """`<parameter>.diff` on a non-.weight parameter ComfyUI's map lists by its own name (what ComfyUI's core loader
    reads, comfy/lora.py `load_lora`: `{x}.diff` for every key-map name x), the modulation included."""
    patcher, base = wan
    gen = torch.Generator().manual_seed(11)
    sd = {f"{PREFIX}{key}.diff": torch.randn(base[key].shape, generator=gen) * 0.05
          for key in ("blocks.1.modulation", "head.modulation")}
    name = write(loras, "modulation_diff.safetensors", sd)
    applied_fully(loras, name, patcher)
    patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=0.5)[0]
    delta = {k[len(PREFIX): -len(".diff")]: v.double() for k, v in sd.items()}
    check_weights(weights_after_full_load(patched, model_keys(base)), base, delta, lambda key: 0.5)
    comfy.model_management.unload_all_models()


def test_a_modulation_of_another_shape_is_reported_and_the_rest_applies(wan, loras):
    patcher, base = wan
    sd = lightx2v_file(base)
    sd[PREFIX + "blocks.1.diff_m"] = torch.zeros(1, 6, 33, dtype=torch.bfloat16)  # a wider model's
    name = write(loras, "wrong_width.safetensors", sd)
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert [key for key, _ in report.problems] == ["diffusion_model.blocks.1.modulation"]
    assert "[1, 6, 33]" in report.problems[0][1] and "[1, 6, 32]" in report.problems[0][1]
    assert len(report.applied) == report.total - 1 and report.unused_keys == []


def test_a_modulation_on_a_model_without_one_is_reported(wan, loras):
    patcher, _ = wan
    name = write(loras, "no_such.safetensors", {PREFIX + "blocks.0.diff_m": torch.zeros(1, 6, 32),
                                                  PREFIX + "blocks.7.diff_m": torch.zeros(1, 6, 32)})
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert list(report.applied) == ["diffusion_model.blocks.0.modulation"]
    assert [key for key, _ in report.problems] == ["diffusion_model.blocks.7.modulation"]


def test_nan_in_a_modulation_is_refused_at_load_naming_the_key():
    sd = {PREFIX + "blocks.0.diff_m": torch.tensor([[[0.0, float("nan")]]])}
    with pytest.raises(LycorisError) as caught:
        parse_state_dict(sd, "nan.safetensors")
    assert caught.value.key == PREFIX + "blocks.0.diff_m" and "NaN" in str(caught.value)


def test_save_writes_the_modulation_as_a_diff_and_it_reads_back(wan, loras):
    """LyCORIS Save of a model carrying the file at 0.5: the modulation (an object patch, glue/object_params.py)
    is written as a `.diff` of the parameter's own name; the saved file applied at 1 gives the same weights."""
    patcher, base = wan
    sd = lightx2v_file(base)
    name = write(loras, "wan_distill_lightx2v.safetensors", sd)
    patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=0.5)[0]
    report = save(patched, None, "saved_distill", Settings(dtype="fp32"))
    assert report.not_written == []
    written = load_file(str(loras / "saved_distill.safetensors"))
    delta = changes(sd, base)
    for key in ("blocks.0.modulation", "blocks.1.modulation", "head.modulation"):  # under Save's (kohya) names
        assert torch.allclose(written[f"lora_unet_{key.replace('.', '_')}.diff"].double(), 0.5 * delta[key],
                              atol=1e-7)
    again = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name="saved_distill.safetensors",
                     strength_model=1.0)[0]
    check_weights(weights_after_full_load(again, model_keys(base)), base, delta, lambda key: 0.5)
    comfy.model_management.unload_all_models()


def test_a_merged_modulation_chain_is_written_as_a_diff():
    """Where a modulation is patched as a weight (a leaf module's own, a hook), Save's exact form writes its change
    as the parameter's `.diff`, never LightX2V's suffix on the parameter's name (which names another parameter)."""
    sd = {"probe.diff_m": torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(2))}
    module = parse_state_dict(sd, "m.safetensors").modules["probe.modulation"]
    w0 = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(3))
    plan = module.plan_for(tuple(w0.shape))
    written = exact_module([Entry(plan, module.tensors, 1.0)], sd["probe.diff_m"], w0, "weight", torch.float32)
    assert set(written.tensors) == {"diff"} and torch.equal(written.tensors["diff"], sd["probe.diff_m"])


def test_convert_to_kohya_writes_the_modulation_as_a_diff(wan, loras):
    patcher, base = wan
    name = write(loras, "wan_distill_lightx2v.safetensors", lightx2v_file(base))
    result = conversion(read(loras / name), patcher, None, "kohya", ERROR, "bf16", "converted")
    assert result.report.not_written == []
    assert result.tensors["lora_unet_blocks_0_modulation.diff"].shape == (1, 6, 32)  # read back exactly (ERROR)
    assert not any(key.endswith(".diff_m") for key in result.tensors)


# --- ComfyUI 0.38's module configs -----------------------------------------------------------------------------------

def config_tensor(value) -> torch.Tensor:
    """What 0.38's `ConfigurableModule.with_config` reads: UTF-8 JSON in a uint8 tensor."""
    return torch.tensor(list(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def test_config_entries_are_read_and_reported_not_counted_as_unloaded(wan, loras):
    patcher, _ = wan
    sd = {PREFIX + "blocks.0.diff_m": torch.zeros(1, 6, 32) + 0.01,
          PREFIX + "blocks.0.self_attn.config": config_tensor({"mode": "sparse", "window": [3, 5]})}
    name = write(loras, "with_config.safetensors", sd)
    lfile = read(loras / name)
    assert [c.key for c in lfile.configs] == [PREFIX + "blocks.0.self_attn.config"]
    assert lfile.configs[0].value == {"mode": "sparse", "window": [3, 5]}
    report = applied_fully(loras, name, patcher)
    assert report.total == 1 and report.warnings == []
    (note,) = report.notes
    assert PREFIX + "blocks.0.self_attn.config" in note and '"window":[3,5]' in note and "not applied" in note
    summary = summarize(loras / name)
    assert summary.unused_keys == 0 and summary.module_count == 1 and summary.notes == [note]
    assert f"note: {note}" in summary.text()


@pytest.mark.parametrize("tensor,why", [
    (torch.tensor([1.0, 2.0]), "uint8"),
    (torch.tensor(list(b"{not json"), dtype=torch.uint8), "JSON"),
    (torch.tensor([0xFF, 0xFE], dtype=torch.uint8), "UTF-8"),
    (torch.zeros(2, 2, dtype=torch.uint8), "1-D"),
])
def test_a_malformed_config_entry_is_reported_by_name_not_a_crash(tensor, why, wan, loras):
    patcher, _ = wan
    key = PREFIX + "blocks.1.cross_attn.config"
    name = write(loras, "bad_config.safetensors", {PREFIX + "blocks.0.diff_m": torch.zeros(1, 6, 32), key: tensor})
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and len(report.applied) == report.total == 1 and report.notes == []
    ((unused, reason),) = report.unused_keys
    assert unused == key and why in reason
    assert summarize(loras / name).unused_keys == 1
