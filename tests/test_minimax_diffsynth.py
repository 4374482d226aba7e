"""DiffSynth-Studio's MiniMax H3 LoRAs on ComfyUI's MiniMax H3: qkv_proj refused (row order unknown) until the user
says which checkpoint the file was trained on (LyCORIS Convert's trained_on), the rest exact.

DiffSynth-Studio (modelscope/DiffSynth-Studio fed7b18f) trains MiniMax H3 LoRAs with PEFT on its own model:
diffsynth/diffusion/training_module.py `add_lora_to_model` = `inject_adapter_in_model(LoraConfig(r, lora_alpha=r,
target_modules))`, the targets of its examples/minimax_h3/model_training/lora/*.sh ("attn.qkv_proj,attn.out_proj,
mlp.fc1,mlp.fc2"); diffsynth/diffusion/logger.py `ModelLogger.save_model` writes the trainable parameters of the
model's state dict (PEFT's `.default.` kept, `pipe.dit.` removed: the original module names) with accelerate's
safetensors save (metadata {"format": "pt"}, no alpha). Its model classes read qkv_proj's rows in two orders under
the same names (diffsynth/configs/model_configs.py, "minimax_h3_dit"): MiniMaxH3DiT (the original checkpoint) per
head, MiniMaxH3DiTComfy (Comfy-Org's checkpoints) as ComfyUI does, and both are trained by its examples. The file
does not say which: qkv_proj is refused by name, with that reason (nodes/glue/keymap.py ROW_ORDER_UNKNOWN); out_proj,
fc1 and fc2 are read alike by both and by ComfyUI (out.reshape(total, heads·head_dim); gate, up = fc1(x).chunk(2),
comfy.ops `_swiglu_eager`), so they apply.

Model: ComfyUI 0.33's own MiniMax H3 at a tiny width, fp32 on the CPU (tests/test_video_dit_peft.py's "minimax-h3");
PEFT is injected into a copy of its diffusion model, whose module names are DiffSynth's (blocks.N.attn.qkv_proj,
token_refiner.blocks.N.mlp.fc1, ...), and its LoRA factors set to seeded random values (a trained adapter). Truth:
PEFT's own merge() of each layer in float64 (test_peft_dit.merged_parameters). Through our loader node at strengths
1 and 0.5, merged (the weights after a full load) and bypassed (each layer's response to unit inputs): each applied
weight within 1e-4 of its largest change, qkv_proj and every other weight untouched. Told the checkpoint, LyCORIS
Convert writes qkv_proj in ComfyUI's rows: for the original checkpoint the file is trained on a copy whose qkv_proj
holds the rows per head (as DiffSynth's MiniMaxH3DiT reads them), and PEFT's merge there, put back in ComfyUI's
order by the inverse of DiffSynth's view, is the truth. MiniMax H3 exists in ComfyUI 0.33 only: skipped on 0.3.75.
"""

import copy

import comfy.model_management
import comfy.supported_models
import diffusers  # noqa: F401  (an oracle of this module: its import error is a failure, not a skip)
import peft
import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core.tools import resize
from lycoris_nodes.lycoris_core.tools.lowrank import RankRule
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import TRAINED_ON_COMFY, TRAINED_ON_ORIGINAL, TRAINED_ON_UNKNOWN
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from lycoris_nodes.nodes.tools.convert import LycorisConvert
from reference.lycoris_factory import SEED
from safetensors.torch import save
from test_fused_split import bypassed_weights
from test_nodes import run_node, weights_after_full_load
from test_peft_dit import merged_parameters, put
from test_tools_resize import write
from test_video_dit_peft import PREFIX, RANK, STRENGTHS, archs  # noqa: F401 (fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not hasattr(comfy.supported_models, "MiniMaxH3"),
                                 reason="MiniMax H3 exists in ComfyUI 0.33 only (the version matrix)")]
loras = test_nodes.loras

TOLERANCE = 1e-4  # of the largest change of each weight
TARGETS = ["attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"]  # DiffSynth's lora/MiniMax-H3-*.sh
STACKS = ("blocks.0", "blocks.1", "token_refiner.blocks.0")


def diffsynth_file(diffusion_model: torch.nn.Module) -> tuple[dict[str, bytes], dict]:
    """({name: bytes}, {weight: (before, PEFT's merge)}): the file DiffSynth-Studio's trainer saves for this model."""
    model = copy.deepcopy(diffusion_model)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS), model)
    gen = torch.Generator().manual_seed(SEED)
    state = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:  # what training moved (PEFT starts lora_B at zero)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
                state[name] = param.detach().clone().contiguous()
    assert all(".lora_A.default.weight" in k or ".lora_B.default.weight" in k for k in state)
    return {"diffsynth_minimax.safetensors": save(state, metadata={"format": "pt"})}, merged_parameters(model)


@pytest.fixture(scope="module")
def minimax(archs):  # noqa: F811
    models = archs["minimax-h3"]
    written, merged = diffsynth_file(models.patcher.model.diffusion_model)
    yield models.patcher, written, merged
    comfy.model_management.unload_all_models()


def test_diffsynth_file_refuses_qkv_proj_by_name_and_applies_the_rest(minimax, loras):
    patcher, written, merged = minimax
    assert {name.removesuffix(".weight") for name in merged} == {f"{s}.{t}" for s in STACKS for t in TARGETS}
    name = put(loras, written)
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert sorted(key for key, _ in report.problems) == [f"{s}.attn.qkv_proj.weight" for s in STACKS]
    assert {reason.split(":")[0] for _, reason in report.problems} == {"row order unknown"}
    assert "original checkpoint" in report.problems[0][1] and "Comfy-Org" in report.problems[0][1]
    assert sorted(report.applied.values()) == sorted(
        f"{PREFIX}{s}.{t}.weight" for s in STACKS for t in TARGETS if t != "attn.qkv_proj")
    assert report.unused_keys == []
    changes = {PREFIX + key: after - before for key, (before, after) in merged.items() if "qkv_proj" not in key}
    for apply_mode in ("merge", "bypass"):
        check_node(patcher, name, changes, apply_mode)


def test_resized_file_keeps_the_mark_so_qkv_proj_stays_refused(minimax, loras):
    """Resize writes a module under its own name: one whose keys kept PEFT's adapter name keeps it (its factors as
    `lora_A/B.default.weight`), else a resized DiffSynth file would apply qkv_proj as ComfyUI's rows."""
    patcher, written, _ = minimax
    lfile = read(loras / put(loras, written))
    result = resize.resize_file(lfile, {}, resize.Settings(RankRule("fixed", RANK), torch.float32), torch.device("cpu"))
    assert all(".default." in key for key in result.tensors if key.endswith(".weight"))
    write(result, loras / "resized.safetensors")
    _, report = map_file(read(loras / "resized.safetensors"), patcher, None, reference=False)
    assert sorted(key for key, _ in report.problems) == [f"{s}.attn.qkv_proj.weight" for s in STACKS]
    assert len(report.applied) == 3 * len(STACKS)


def per_head(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """ComfyUI's [q; k; v] rows as the original checkpoint holds them for DiffSynth's MiniMaxH3Attention, which reads
    qkv_proj(x).view(total, heads, 3, head_dim) (modelscope/DiffSynth-Studio diffsynth/models/minimax_h3_dit.py), where
    ComfyUI reads view(total, 3, heads, head_dim)."""
    rows, columns = weight.shape
    return weight.reshape(3, rows // 3 // head_dim, head_dim, columns).transpose(0, 1).reshape(rows, columns)


def as_comfy(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """per_head undone: the original checkpoint's rows in ComfyUI's order."""
    rows, columns = weight.shape
    return weight.reshape(rows // 3 // head_dim, 3, head_dim, columns).transpose(0, 1).reshape(rows, columns)


@pytest.fixture(scope="module")
def original(minimax):
    """(the file DiffSynth saves when trained on the original checkpoint: its MiniMaxH3DiT holds qkv_proj per head,
    {ComfyUI weight key: PEFT's change, in ComfyUI's rows}). The truth is PEFT's merge on the per-head model, put in
    ComfyUI's order by as_comfy, an inverse transcribed from DiffSynth's view, not from the pack."""
    patcher = minimax[0]
    model = copy.deepcopy(patcher.model.diffusion_model)
    head_dims = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".attn"):
                head_dims[name + ".qkv_proj.weight"] = module.q_norm.weight.shape[0]
                module.qkv_proj.weight.copy_(per_head(module.qkv_proj.weight, head_dims[name + ".qkv_proj.weight"]))
    written, merged = diffsynth_file(model)
    changes = {}
    for key, (before, after) in merged.items():
        change = after - before
        changes[PREFIX + key] = as_comfy(change, head_dims[key]) if key in head_dims else change
    return written, changes


def converted(loras, name: str, patcher, trained_on: str) -> str:
    """LyCORIS Convert's kohya file of `name`, told which checkpoint it was trained on; its name in the loras folder."""
    output = f"converted-{len(trained_on)}"
    report = run_node(LycorisConvert, lycoris_name=name, target="kohya", model=patcher, output_name=output,
                      overwrite=True, trained_on=trained_on)
    assert report is not None
    return output + ".safetensors"


@pytest.mark.parametrize("trained_on", [TRAINED_ON_COMFY, TRAINED_ON_ORIGINAL])
def test_told_which_checkpoint_convert_writes_qkv_proj_in_comfyuis_rows(trained_on, minimax, original, loras):
    """Told the checkpoint (LyCORIS Convert's trained_on), qkv_proj goes to ComfyUI's rows as that checkpoint reads
    them: as they are for Comfy-Org's, from per head for the original. The converted file (kohya names, no
    `.default.`) then applies fully in the loader, merged and bypassed, equal to PEFT's merge."""
    patcher, written, merged = minimax
    if trained_on == TRAINED_ON_ORIGINAL:
        written, changes = original
    else:
        changes = {PREFIX + key: after - before for key, (before, after) in merged.items()}
    name = put(loras, {f"diffsynth-{len(trained_on)}.safetensors": next(iter(written.values()))})
    _, told = map_file(read(loras / name), patcher, None, reference=False, trained_on=trained_on)
    assert told.problems == [] and len(told.applied) == len(changes)
    result = converted(loras, name, patcher, trained_on)
    _, report = map_file(read(loras / result), patcher, None, reference=False)
    assert report.problems == [] and len(report.applied) == len(changes)
    for apply_mode in ("merge", "bypass"):
        check_node(patcher, result, changes, apply_mode)


def test_not_told_convert_leaves_qkv_proj_out_with_the_reason(minimax, loras):
    patcher, written, _ = minimax
    name = put(loras, written)
    result = converted(loras, name, patcher, TRAINED_ON_UNKNOWN)
    _, report = map_file(read(loras / result), patcher, None, reference=False)
    assert sorted(report.applied.values()) == sorted(
        f"{PREFIX}{s}.{t}.weight" for s in STACKS for t in TARGETS if t != "attn.qkv_proj")


def check_node(patcher, name: str, changes: dict[str, torch.Tensor], apply_mode: str) -> None:
    """Our loader node at each strength: each changed weight is W + m·ΔW, every other block weight as it was."""
    state = {k: v.detach().clone() for k, v in patcher.model.state_dict().items()
             if k.endswith(".weight") and (".attn." in k or ".mlp." in k) and "norm" not in k}
    keys = sorted(state)
    assert set(changes) <= set(keys) and any("qkv_proj" in k for k in keys)
    for strength in STRENGTHS:
        patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength,
                           apply_mode=apply_mode)[0]
        comfy.model_management.unload_all_models()
        got = weights_after_full_load(patched, keys) if apply_mode == "merge" else bypassed_weights(patched, keys)
        for key in keys:
            base = state[key].double()
            if key not in changes:
                assert (got[key].double() - base).abs().max() <= 1e-6 * base.abs().max(), f"{key} changed"
                continue
            change = strength * changes[key]
            error = (got[key].double() - (base + change)).abs().max()
            assert error <= TOLERANCE * change.abs().max(), f"{key} @ {strength} {apply_mode}: {error:.3g}"
    comfy.model_management.unload_all_models()
