"""Resize LyCORIS (issue #14): any algorithm the pack reads, as plain LoRA/LoCon of a new rank.

Truth is independent of the code under test: the reference files of lycoris-lora 4.1.3 (tests/reference), the change
our loader applies for each module (patch.change, itself tested against the reference's forward), an independent
`torch.linalg.svd` of that change (Eckart–Young: the best rank-r error is √(Σ_{i>r} σᵢ²)/‖ΔW‖), kohya's rank rules
written out from their definitions, ComfyUI's own core LoRA loader, and the written file read back by our loader."""

import math

import pytest
import torch
from lycoris_nodes.lycoris_core import LycorisError, load
from lycoris_nodes.lycoris_core.tools import resize, tucker
from lycoris_nodes.lycoris_core.tools.changes import dense_change
from lycoris_nodes.lycoris_core.tools.lowrank import RankRule, choose_rank, spectrum
from reference.lycoris_factory import VARIANTS, base_params, layer_of
from safetensors.torch import save_file
from test_nodes import loras, sd15  # noqa: F401  (fixtures)
from test_peft_diffusers_names import twin  # noqa: F401  (fixture)

CPU = torch.device("cpu")
EXACT = 1e-4  # fp32, full rank: relative Frobenius error of the reloaded change (the bound)
SAME = 2e-5  # reported vs measured vs Eckart-Young, fp32


@pytest.fixture(scope="module")
def weights():
    return base_params(torch.float32)


def bases_for(lfile, weights) -> dict[str, resize.Base]:
    """The factory model's weight for every module of a reference file (what MODEL/CLIP give the node)."""
    bases = {}
    for key, module in lfile.modules.items():
        layer = layer_of(module.prefix)
        param = weights[layer][module.param] if layer else None
        if param is not None:
            bases[key] = resize.Base(tuple(param.shape), param.float())
    return bases


def truth_changes(lfile, bases) -> dict[str, torch.Tensor]:
    """The loader's own full-strength change of every module (patch.change), fp32."""
    out = {}
    for key, module in lfile.modules.items():
        base = bases[key]
        out[key] = dense_change(module.plan_for(base.shape), module.tensors, 1.0, base.weight, CPU)
    return out


def reloaded_changes(path, bases) -> dict[str, torch.Tensor]:
    """The written file read back by our loader: each module's change on the same weights."""
    lfile = load(path)
    return truth_changes(lfile, bases)


def comfy_changes(path, bases) -> dict[str, torch.Tensor]:
    """The written file read by ComfyUI's core LoRA loader (comfy.lora.load_lora, then its calculate_weight on each
    base weight): each weight's change, by our module key."""
    import comfy.lora
    import comfy.utils

    patches = comfy.lora.load_lora(comfy.utils.load_torch_file(str(path)),
                                   {key.rsplit(".", 1)[0]: key.rsplit(".", 1)[0] + ".weight" for key in bases})
    out = {}
    for key, patch in patches.items():
        weight = bases[key].weight.float()
        out[key] = comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], weight.clone(), key) - weight
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.double()
    norm = float(b.norm())
    return float((a.double().reshape(b.shape) - b).norm()) / norm if norm > 0 else float(a.double().norm())


def write(result: resize.Result, path) -> None:
    save_file({k: v.contiguous() for k, v in result.tensors.items()}, str(path))


def by_layer(keys) -> dict[str, str]:
    return {k: k for k in keys}


# --- every algorithm variant ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant_id", [v.id for v in VARIANTS])
def test_full_rank_reproduces_every_variant(reference_files, weights, variant_id, tmp_path, one_thread):
    """Rank 4096 (more than any layer has): every module reproduces the change within 1e-4 when loaded back,
    and the reported error is the measured one."""
    lfile = load(reference_files[variant_id].path)
    bases = bases_for(lfile, weights)
    assert set(bases) == set(lfile.modules), "every module maps onto the factory model"
    settings = resize.Settings(RankRule("fixed", 4096), torch.float32, tucker=True)
    result = resize.resize_file(lfile, bases, settings, CPU)
    assert not result.not_written
    write(result, tmp_path / "out.safetensors")
    truth = truth_changes(lfile, bases)
    reloaded = reloaded_changes(tmp_path / "out.safetensors", bases)
    assert set(reloaded) == set(truth)
    for key, change in truth.items():
        error = relative(reloaded[key], change)
        assert error <= EXACT, f"{key}: {error:.2e}"
        assert abs(result.modules[key].error - error) <= SAME, key
    if variant_id == "locon_tucker":  # Tucker rank 4 on the 3×3 Conv2d: exact with fewer parameters (LoHa's is 16: not)
        assert result.modules["lycoris_conv2d.weight"].form == "locon-tucker", result.modules
    comfy = comfy_changes(tmp_path / "out.safetensors", bases)
    assert set(comfy) == set(truth)
    for key, change in comfy.items():  # ComfyUI's core loader reads the output (Tucker forms too) as ours does
        assert relative(change, reloaded[key]) <= 1e-5, f"{key}: ComfyUI's core loader differs"


@pytest.mark.parametrize("variant_id", [v.id for v in VARIANTS])
def test_low_rank_error_is_reported_measured_and_optimal(reference_files, weights, variant_id, tmp_path, one_thread):
    """Rank 2 (flat LoRA/LoCon, Tucker off): reported error = error of the reloaded file = Eckart–Young's tail from
    an independent SVD of the dense change."""
    lfile = load(reference_files[variant_id].path)
    bases = bases_for(lfile, weights)
    settings = resize.Settings(RankRule("fixed", 2), torch.float32, tucker=False)
    result = resize.resize_file(lfile, bases, settings, CPU)
    write(result, tmp_path / "out.safetensors")
    truth = truth_changes(lfile, bases)
    reloaded = reloaded_changes(tmp_path / "out.safetensors", bases)
    for key, change in truth.items():
        record = result.modules[key]
        measured = relative(reloaded[key], change)
        assert abs(record.error - measured) <= SAME, f"{key}: reported {record.error:.3e}, measured {measured:.3e}"
        if change.ndim < 2 or lfile.modules[key].param != "weight":
            assert record.form == "full" and measured <= EXACT, key
            continue
        s = torch.linalg.svd(change.double().reshape(change.shape[0], -1))[1]
        optimal = math.sqrt(float(s[2:].square().sum()) / float(s.square().sum())) if float(s[0]) > 0 else 0.0
        assert record.rank <= 2 and abs(measured - optimal) <= SAME, \
            f"{key}: {measured:.4e} vs Eckart-Young {optimal:.4e}"


# --- rank rules -------------------------------------------------------------------------------------------------------

SPECTRUM = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25])  # Σσ = 15.75, Σσ² = 85.3125
# Expected ranks written out from kohya's sd-scripts networks/resize_lora.py (rank_resize: new_rank = index + 1, with
# index_sv_ratio = #{σ > σ₁/v}, index_sv_cumulative = searchsorted(cumsum(σ)/Σσ, v) + 1, index_sv_fro =
# searchsorted(cumsum(σ²)/Σσ², v²) + 1, each index clamped to [1, n − 1]; rank 1 when σ₁ ≤ MIN_SV = 1e-6; capped at
# --new_rank):
KOHYA_TABLE = [
    ("sv_ratio", 3.0, None, 3),  # σ > 2.67: {8, 4} -> index 2 -> rank 3
    ("sv_ratio", 10.0, None, 5),  # σ > 0.8: {8, 4, 2, 1} -> 4 -> 5
    ("sv_ratio", 100.0, None, 6),  # all 6 -> clamped to 5 -> 6
    ("sv_cumulative", 0.5, None, 2),  # cumsum/15.75 = .508 .762 .889 .952 .984 1: searchsorted(.5) = 0 -> 1 -> 2
    ("sv_cumulative", 0.9, None, 5),  # searchsorted(.9) = 3 -> 4 -> 5
    ("sv_fro", 0.5, None, 2),  # cumsum(σ²)/85.3 = .750 .938 .985 .996 .9993 1: searchsorted(.25) = 0 -> 1 -> 2
    ("sv_fro", 0.9, None, 3),  # searchsorted(.81) = 1 -> 2 -> 3
    ("sv_fro", 0.999, None, 6),  # searchsorted(.998) = 4 -> 5 -> 6
    ("sv_fro", 0.999, 4, 4),  # capped by --new_rank
    ("sv_cumulative", 0.9, 2, 2),
]


@pytest.mark.parametrize("mode,value,cap,expected", KOHYA_TABLE)
def test_kohya_rules_give_kohyas_ranks(mode, value, cap, expected):
    assert choose_rank(SPECTRUM, RankRule(mode, value, cap)) == expected


def test_kohya_zero_change_is_rank_one():
    assert choose_rank(torch.tensor([5e-7, 1e-7, 0.0]), RankRule("sv_fro", 0.9)) == 1


@pytest.mark.parametrize("mode,value", [("threshold", 1.5), ("threshold", 0.3), ("ratio", 0.2), ("ratio", 0.05),
                                        ("quantile", 0.9), ("quantile", 0.6)])
def test_lycoris_rules_give_lycoris_ranks(mode, value):
    """LyCORIS' own extractor (lycoris.utils.extract_linear, 4.1.3) on a matrix with this spectrum: same rank."""
    from lycoris.utils import extract_linear

    gen = torch.Generator().manual_seed(7)
    u = torch.linalg.qr(torch.randn(16, 6, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(16, 6, generator=gen, dtype=torch.float64))[0]
    matrix = (u * SPECTRUM.double()) @ v.T
    (down, _up, _diff), kind = extract_linear(matrix, mode, value)
    assert kind == "low rank"
    assert choose_rank(spectrum(matrix.float()).s, RankRule(mode, value)) == down.shape[0]


@pytest.mark.parametrize("mode,rank,value,message", [
    ("fixed", 0, 0.0, "at least 1"),
    ("sv_ratio", 8, 0.5, r"\[1, inf\]"),
    ("sv_fro", 8, 1.5, r"\(0, 1\]"),
    ("sv_cumulative", 8, 0.0, r"\(0, 1\]"),
    ("ratio", 8, -0.1, r"\[0, 1\]"),
    ("knee", 8, 0.5, "unknown rank rule"),
])
def test_nonsense_settings_are_refused(mode, rank, value, message):
    with pytest.raises(LycorisError, match=message):
        resize.rank_rule(mode, rank, value)


# --- randomized SVD, Tucker ---------------------------------------------------------------------------------------------

def test_randomized_svd_is_within_one_percent_of_the_exact_error(one_thread):
    """A dense 1024×1280 change with σᵢ = 1/√(i+1) (a slow decay, the hard case), fixed rank 32: lowrank takes the
    randomized SVD (svd_lowrank, 8 oversamples, 2 power iterations). Measured (CPU, seeds 11 and 0): exact
    ε(32) = 0.6779, randomized 0.6808 (0.43% above, within 1%); the reported error is the measured one."""
    gen = torch.Generator().manual_seed(11)
    u = torch.linalg.qr(torch.randn(1024, 1024, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(1280, 1024, generator=gen))[0]
    s = 1 / torch.arange(1, 1025, dtype=torch.float32).sqrt()
    change = (u * s) @ v.T
    with torch.random.fork_rng():
        torch.manual_seed(0)  # svd_lowrank's random test matrix: the same numbers on every run
        resized = resize.resize_weight(change, (1024, 1280), resize.Settings(RankRule("fixed", 32), torch.float32))
    exact = math.sqrt(float(s[32:].double().square().sum() / s.double().square().sum()))
    up, down = resized.tensors["lora_up.weight"], resized.tensors["lora_down.weight"]
    measured = relative(up @ down, change)
    assert resized.record.rank == 32 and not spectrum(change, 32).complete  # the randomized path was taken
    assert abs(resized.record.error - measured) <= 1e-5
    assert exact <= measured <= exact * 1.01, f"randomized {measured:.4f} vs exact {exact:.4f}"


def conv_change(rank_out, rank_in, seed, out=48, inputs=40, kernel=(3, 3)):
    """A conv change whose out- and in-mode ranks are (rank_out, rank_in): a Tucker product."""
    gen = torch.Generator().manual_seed(seed)
    core = torch.randn(rank_out, rank_in, *kernel, generator=gen)
    return torch.einsum("ij...,oi,nj->on...", core, torch.randn(out, rank_out, generator=gen),
                        torch.randn(inputs, rank_in, generator=gen))


def reloaded_conv(tensors, shape, tmp_path) -> torch.Tensor:
    save_file({f"lora_unet_conv.{k}": v for k, v in tensors.items()}, str(tmp_path / "conv.safetensors"))
    (module,) = load(tmp_path / "conv.safetensors").modules.values()
    return dense_change(module.plan_for(shape), module.tensors, 1.0, torch.zeros(shape), CPU)  # LoCon: W unread


def test_tucker_is_chosen_where_it_pays_and_its_error_is_reported(tmp_path):
    """A 3×3 conv change of Tucker rank 4: its flat rank is 36, so the exact flat LoCon costs 36·(48 + 360) = 14688
    parameters, the rank-4 Tucker form 4·88 + 16·9 = 496: Tucker is written, exact. At a fixed rank 6 (flat error
    > 0) Tucker is taken at the smallest rank whose error is no larger, with fewer parameters. A generic (random)
    change at rank 2 gets no Tucker form: no smaller Tucker rank is as exact."""
    shape = (48, 40, 3, 3)
    change = conv_change(4, 4, seed=1)
    for rank in (36, 6):
        resized = resize.resize_weight(change, shape, resize.Settings(RankRule("fixed", rank), torch.float32))
        flat = resize.resize_weight(change, shape, resize.Settings(RankRule("fixed", rank), torch.float32, False))
        assert resized.record.form == "locon-tucker" and "lora_mid.weight" in resized.tensors
        assert tucker.parameters(shape, resized.record.rank) < tucker.flat_parameters(shape, rank)
        assert resized.record.error <= flat.record.error + tucker.SAME_ERROR
        measured = relative(reloaded_conv(resized.tensors, shape, tmp_path), change)
        assert abs(resized.record.error - measured) <= SAME, f"rank {rank}: {resized.record.error} vs {measured}"
    exact = resize.resize_weight(change, shape, resize.Settings(RankRule("fixed", 36), torch.float32))
    assert exact.record.rank == 4 and exact.record.error <= EXACT
    generic = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    resized = resize.resize_weight(generic, shape, resize.Settings(RankRule("fixed", 2), torch.float32))
    assert resized.record.form == "locon" and "lora_mid.weight" not in resized.tensors


def test_fp16_error_is_measured_after_rounding(tmp_path):
    """At full rank the only error left is fp16's rounding of the factors: reported = measured on the reloaded file,
    and above the fp32 error."""
    change = conv_change(3, 5, seed=4)
    shape = tuple(change.shape)
    half = resize.resize_weight(change, shape, resize.Settings(RankRule("fixed", 4096), torch.float16))
    assert all(t.dtype == torch.float16 for k, t in half.tensors.items() if k != "alpha")
    measured = relative(reloaded_conv(half.tensors, shape, tmp_path), change)
    assert 1e-5 < measured < 1e-2
    assert abs(half.record.error - measured) <= 1e-6


# --- the node, on the tiny SD1.5 with files lycoris-lora writes for it -------------------------------------------------

def resize_node(name, output, **options):
    from lycoris_nodes.nodes.tools.resize import LycorisResize
    from node_runner import execute

    inputs = {"rule": "fixed", "rank": 4096, "value": 0.9, "dtype": "fp32", **options}
    return execute(LycorisResize, lycoris_name=name, output_name=output, **inputs).result


def per_module_errors(model, source, written) -> dict[str, float]:
    """Relative error of each written module's change (read back by our loader) against the source file's."""
    from test_tools_convert import patched_by_our_loader

    base = model.model.state_dict()
    want, got = patched_by_our_loader(model, source), patched_by_our_loader(model, written)
    assert sorted(got) == sorted(want)
    return {key: relative(got[key] - base[key].float(), want[key] - base[key].float()) for key in want}


def test_node_resizes_loha_without_a_model_exactly_and_comfy_reads_it(sd15, twin, loras, one_thread):  # noqa: F811
    """LoHa does not read W: no MODEL needed. Full rank, fp32: the reloaded change equals the source's within 1e-4,
    and ComfyUI's core LoRA loader makes the same weights as ours of the written file."""
    from test_tools_convert import core_loader_patched, lycoris_file, patched_by_our_loader

    model, _clip = sd15
    unet, _ = twin
    name = lycoris_file(unet, loras, "loha.safetensors", seed=5, algo="loha")
    written, report = resize_node(name, "resized/loha")
    errors = per_module_errors(model, loras / name, loras / written)
    assert max(errors.values()) <= EXACT, report
    ours = patched_by_our_loader(model, loras / written)
    comfy = core_loader_patched(model, loras / written)
    base = model.model.state_dict()
    assert sorted(comfy) == sorted(ours)
    for key in ours:
        assert relative(comfy[key] - base[key].float(), ours[key] - base[key].float()) <= 1e-5, key
    lfile = load(loras / written)
    assert {m.algorithm.name for m in lfile.modules.values()} == {"locon"}
    assert {m.prefix for m in lfile.modules.values()} == {m.prefix for m in load(loras / name).modules.values()}
    assert "not written" not in report
    # The header says the ranks written (each module's own, from the file), the next line what was asked (a cap).
    ranks = sorted({r for r in (m.layout.rank for m in lfile.modules.values())})
    first, asked = report.splitlines()[:2]
    want = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}–{ranks[-1]}"
    assert f" modules, {want}, " in first and ranks[-1] < 4096, first
    assert asked.startswith("asked: rank 4096, float32; source: "), asked


def test_node_dora_needs_the_base_model(sd15, twin, loras, one_thread):  # noqa: F811
    """DoRA reads W: without MODEL it is refused (default) or, if asked, left out and listed; with MODEL at rank 2
    in fp16 each module's reported error is the one measured on the reloaded file, and the metadata records it."""
    import json

    from safetensors import safe_open
    from test_tools_convert import lycoris_file

    model, _clip = sd15
    unet, _ = twin
    name = lycoris_file(unet, loras, "dora.safetensors", seed=6, algo="locon", dora_wd=True, wd_on_output=True)
    with pytest.raises(LycorisError, match="connect the MODEL"):
        resize_node(name, "resized/dora")
    with pytest.raises(LycorisError, match="nothing to write"):
        resize_node(name, "resized/dora", on_missing_base="skip-and-report")
    assert not (loras / "resized" / "dora.safetensors").exists()
    written, _report = resize_node(name, "resized/dora", rank=2, dtype="fp16", model=model)
    measured = per_module_errors(model, loras / name, loras / written)
    with safe_open(str(loras / written), "pt") as f:
        recorded = json.loads(f.metadata()["lycoris_nodes.modules"])
    _, mapped = __import__("lycoris_nodes.nodes.glue.apply", fromlist=["map_file"]).map_file(
        load(loras / name), model, None, reference=False)
    by_weight = {applied.target.key: key for key, applied in mapped.targets.items()}
    assert sorted(by_weight[k] for k in measured) == sorted(recorded)
    for weight_key, error in measured.items():
        record = recorded[by_weight[weight_key]]
        assert record["rank"] <= 2 and 0 < error
        assert abs(record["error"] - error) <= 1e-3 * error + 1e-6, weight_key  # the metadata keeps 3 digits
    with pytest.raises(LycorisError, match="exists"):
        resize_node(name, "resized/dora", rank=2, model=model)


def test_cli_resizes_a_file(sd15, twin, tmp_path):  # noqa: F811
    """The command line, one run (ComfyUI's start is most of its ~12 s): a LoHa file lycoris-lora wrote, to rank 2
    LoCon in fp16 (no checkpoint needed)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_tools_convert import keys_of, lycoris_file

    repo = Path(__file__).resolve().parent.parent
    lora_dir = tmp_path / "models" / "loras"
    lora_dir.mkdir(parents=True)
    unet, _ = twin
    name = lycoris_file(unet, lora_dir, "loha.safetensors", seed=8, algo="loha")
    comfy_dir = os.environ.get("COMFYUI_PATH", str(repo / ".deps" / "ComfyUI"))
    run = subprocess.run([sys.executable, str(repo / "lycoris_tools.py"), "--comfyui", comfy_dir, "--cpu",
                          "--base-directory", str(tmp_path), "resize", name, "--rank", "2", "--dtype", "fp16",
                          "-o", "small"], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    source = load(lora_dir / name)
    assert f"{len(source.modules)} modules" in run.stdout and "rank 2" in run.stdout
    written = load(lora_dir / "small.safetensors")
    assert {m.prefix for m in written.modules.values()} == {m.prefix for m in source.modules.values()}
    assert all(k.endswith(("lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha"))
               for k in keys_of(lora_dir / "small.safetensors"))
    assert max(m.layout.rank for m in written.modules.values()) <= 2 or any(
        "lora_mid.weight" in m.tensors for m in written.modules.values())


# --- PEFT formats -------------------------------------------------------------------------------------------------------

def peft_configs():
    from peft import BOFTConfig, IA3Config, LoraConfig, OFTConfig

    targets = ["lin", "conv"]
    return {
        "lora": LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets),
        "oft": OFTConfig(r=0, oft_block_size=8, init_weights=False, target_modules=targets),
        "boft": BOFTConfig(boft_block_size=4, init_weights=False, target_modules=targets),
        "ia3": IA3Config(init_ia3_weights=False, target_modules=targets, feedforward_modules=["conv"]),
    }


@pytest.mark.parametrize("kind", ["lora", "oft", "boft", "ia3"])
def test_peft_files_resize_to_peft_merge(kind, tmp_path, one_thread):
    """A PEFT adapter (save_pretrained) on a Linear and a 3×3 Conv: at full rank, the written LoRA/LoCon (and bias
    diffs) reloaded by our loader give PEFT's own merge_and_unload within 1e-4 of the change."""
    from peft import get_peft_model

    torch.manual_seed(len(kind))
    base = torch.nn.Sequential()
    base.add_module("lin", torch.nn.Linear(32, 48))
    base.add_module("conv", torch.nn.Conv2d(16, 32, 3))
    before = {k: v.detach().clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, peft_configs()[kind])
    with torch.no_grad():
        for name, param in model.named_parameters():  # move PEFT's OFT/BOFT/(IA)3 away from their identity start
            if param.requires_grad:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "peft")
    merged = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    lfile = load(tmp_path / "peft" / "adapter_model.safetensors")
    bases = {key: resize.Base(tuple(before[key.removeprefix("base_model.model.")].shape),
                              before[key.removeprefix("base_model.model.")]) for key in lfile.modules}
    result = resize.resize_file(lfile, bases, resize.Settings(RankRule("fixed", 4096), torch.float32), CPU)
    write(result, tmp_path / "out.safetensors")
    written = load(tmp_path / "out.safetensors")
    assert {m.algorithm.name for m in written.modules.values() if m.param == "weight"} == {"locon"}
    changed = [k for k in before if not torch.equal(merged[k], before[k])]
    assert changed and set(changed) <= {key.removeprefix("base_model.model.") for key in lfile.modules}
    got = reloaded_changes(tmp_path / "out.safetensors", bases)
    for key, change in got.items():
        name = key.removeprefix("base_model.model.")
        truth = merged[name].float() - before[name].float()
        if float(truth.norm()) == 0:
            assert float(change.norm()) <= 1e-6, key
            continue
        assert relative(change, truth) <= EXACT, f"{key}: {relative(change, truth):.2e}"
