"""What a file is, read from its header: `summarize`, `trigger_words`, `infer_family`, `declared_family`, `block_of`.

Truth is independent of the code under test: files made by the LyCORIS reference (lycoris-lora 4.1.3) are checked
against the reference network's own modules (class, lora_dim, alpha buffer, wd/wd_on_output, tucker), dtypes against
safetensors' own reader, sizes against the file system; hand-written files against the tensors written here.
"""

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from comfy_env import REPO_ROOT
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core import summary as summary_module
from lycoris_nodes.lycoris_core.blocks import block_of
from lycoris_nodes.lycoris_core.families import declared_family, family_id, infer_family
from lycoris_nodes.lycoris_core.summary import summarize, trigger_words
from lycoris_nodes.nodes.glue.cache import read
from safetensors import safe_open
from safetensors.torch import save_file

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended, not prepended: ComfyUI's own `nodes` must keep winning

from reference import lycoris_factory as factory


def rand(*shape, seed, s=0.05):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * s


def lora(prefix, out, inn, seed=0, rank=4, alpha=2.0, kernel=()):
    """kohya/LyCORIS LoRA keys (lora_up/lora_down/alpha)."""
    return {f"{prefix}.lora_up.weight": rand(out, rank, *[1] * len(kernel), seed=seed),
            f"{prefix}.lora_down.weight": rand(rank, inn, *kernel, seed=seed + 1),
            f"{prefix}.alpha": torch.tensor(float(alpha))}


def peft(prefix, out, inn, seed=0, rank=4):
    """diffusers/PEFT LoRA keys: no alpha in the file."""
    return {f"{prefix}.lora_A.weight": rand(rank, inn, seed=seed), f"{prefix}.lora_B.weight": rand(out, rank, seed=seed + 1)}


def write(path: Path, sd: dict, metadata: dict | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def header_dtypes(path: Path) -> dict[str, int]:
    """dtype counts as safetensors itself reads them (e.g. {"F32": 21})."""
    with safe_open(str(path), "pt") as f:
        return dict(Counter(f.get_slice(k).get_dtype() for k in f.keys()))  # noqa: SIM118 - safe_open is not a dict


# --- files made by the reference ------------------------------------------------------------------------------------

LABELS = {"LoConModule": "LoCon", "LohaModule": "LoHa", "LokrModule": "LoKr", "IA3Module": "(IA)³",
          "GLoRAModule": "GLoRA"}


def label_of(kind: str, state: dict) -> str:
    """LoCon on a layer without a kernel wider than 1 (a Linear, a 1×1 conv) is a plain LoRA to its users."""
    down = state.get("lora_down.weight")
    if kind == "LoConModule" and "lora_mid.weight" not in state and down is not None and down[0, 0].numel() == 1:
        return "LoRA"
    return LABELS[kind]


def reference_file(directory: Path, variant_id: str, metadata: dict | None = None, **kwargs):
    """(path, network): the variant's network made by lycoris-lora on the factory's tiny model, saved as LyCORIS does."""
    variant = factory.BY_ID[variant_id]
    if kwargs:
        variant = dataclasses.replace(variant, kwargs={**variant.kwargs, **kwargs})
    model = factory.base_model(torch.float32, variant.container)
    net = factory._create(variant, model, variant.layers, directory)
    factory._randomise(net, torch.Generator().manual_seed(7))
    factory._apply(net)  # the network's state dict holds its modules only once applied
    path = directory / f"{variant_id}.safetensors"
    net.save_weights(str(path), variant.save_dtype, metadata or {})
    return path, net


@dataclasses.dataclass
class Truth:
    key: str
    algorithm: str
    rank: int | None
    alpha: float | None
    conv: bool
    dora_axis: str | None
    tucker: bool
    params: int


def truth_of(lora_module, save_dtype: torch.dtype) -> Truth:
    """What the reference module itself says it is (alpha as save_weights stores it in `save_dtype`)."""
    kind = type(lora_module).__name__
    state = lora_module.state_dict()
    wd = bool(getattr(lora_module, "wd", False))
    if kind == "IA3Module":
        rank = None
    elif kind == "LokrModule" and lora_module.use_w1 and lora_module.use_w2:
        rank = None  # both Kronecker factors stored in full: no low-rank factor at all
    else:
        rank = lora_module.lora_dim
    return Truth(
        key=f"{lora_module.lora_name}.weight",
        algorithm=label_of(kind, state) + ("+DoRA" if wd else ""),
        rank=rank,
        alpha=float(state["alpha"].to(save_dtype)) if "alpha" in state else None,
        conv=factory.LAYER[factory.layer_of(lora_module.lora_name)].kind == "conv",
        dora_axis=("out" if lora_module.wd_on_out else "in") if wd else None,
        tucker=bool(getattr(lora_module, "tucker", False)),
        params=sum(t.numel() for name, t in state.items() if name not in ("alpha", "on_input")),
    )


def span(values):
    values = [v for v in values if v is not None]
    return {"min": min(values), "max": max(values)} if values else None


# conv_visible: the reference writes every conv module's factors with their kernel dims (LoCon's lora_down, tucker
# cores, (IA)³), so the header shows which modules are convs. LoHa/LoKr/GLoRA factors may flatten the kernel into
# 2-D (r, in·k·k): there a conv module may look like a Linear (see test_conv_rank_of_flattened_loha), never the reverse.
@pytest.mark.parametrize("variant_id,kwargs,conv_visible", [
    ("locon", {"linear_dim": 8, "linear_alpha": 4.0, "conv_dim": 2, "conv_alpha": 1.0}, True),  # ranges
    ("loha", {}, False),
    ("loha_tucker", {}, True),
    ("lokr", {}, False),
    ("lokr_full_matrix", {}, True),
    ("lokr_decompose_both", {}, False),
    ("lokr_tucker", {}, True),
    ("locon_dora_out", {}, True),
    ("locon_dora_in", {}, True),
    ("lokr_dora_in", {}, False),
    ("loha_dora_out", {}, False),
    ("locon_fp16_file", {}, True),
    ("locon_bf16_file", {}, True),
    ("ia3", {}, True),
    ("glora", {}, False),
])
def test_reference_file(variant_id, kwargs, conv_visible, tmp_path):
    path, net = reference_file(tmp_path, variant_id, **kwargs)
    truths = [truth_of(m, factory.BY_ID[variant_id].save_dtype) for m in net.loras]
    s = summarize(path)

    assert s.name == path.name and s.size_bytes == path.stat().st_size
    assert s.module_count == len(net.loras) and s.unused_keys == 0
    assert s.algorithms == dict(Counter(t.algorithm for t in truths))
    assert s.dtypes == header_dtypes(path)
    assert s.params == sum(t.params for t in truths)
    got = {m.key: m for m in s.modules}
    assert set(got) == {t.key for t in truths}
    for t in truths:
        m = got[t.key]
        assert (m.algorithm, m.rank, m.dora_axis, m.tucker, m.params) == \
            (t.algorithm, t.rank, t.dora_axis, t.tucker, t.params), t.key
        assert m.conv == t.conv if conv_visible else m.conv <= t.conv, t.key
        assert m.alpha == pytest.approx(t.alpha) if t.alpha is not None else m.alpha is None
    assert s.rank == span([t.rank for t in truths])
    if conv_visible:
        assert s.conv_rank == span([t.rank for t in truths if t.conv])
    else:
        assert s.conv_rank == span([m.rank for m in s.modules if m.conv])
    alphas = span([t.alpha for t in truths])
    assert s.alpha == (None if alphas is None else pytest.approx(alphas))
    axes = {t.dora_axis for t in truths if t.dora_axis}
    assert s.dora_axis == (axes.pop() if axes else None)
    assert s.tucker == any(t.tucker for t in truths)
    # nothing declared, and the factory's layer names say nothing about a base model
    assert s.base_model == {"declared": None, "inferred": None}
    assert s.metadata_count == 0 and s.trigger_words == [] and s.title is None and s.lycoris_config is None
    assert s.to_json()["module_count"] == len(net.loras) and "modules" not in s.to_json()
    json.dumps(s.to_json(with_modules=True), allow_nan=False)  # what the route and the UI payload serve


def test_reference_ranges_are_really_ranges(tmp_path):
    """The case above that must produce a range, spelled out: linear rank 8 / alpha 4, conv rank 2 / alpha 1."""
    path, _net = reference_file(tmp_path, "locon", linear_dim=8, linear_alpha=4.0, conv_dim=2, conv_alpha=1.0)
    s = summarize(path)
    assert s.rank == {"min": 2, "max": 8}
    assert s.conv_rank == {"min": 2, "max": 8}  # LyCORIS gives 1×1 convs the linear rank
    assert {m.rank for m in s.modules if m.key.startswith("lycoris_conv2d_1x1")} == {8}
    assert s.alpha == {"min": 1.0, "max": 4.0}
    assert "rank 2–8, alpha 1–4" in s.text() and "conv layers: rank 2–8" in s.text()


def test_reference_full_diff_counts_weight_and_bias_modules(tmp_path):
    path, net = reference_file(tmp_path, "full")
    with_bias = [m.lora_name for m in net.loras if "diff_b" in m.state_dict()]
    s = summarize(path)
    assert s.algorithms == {"Full": len(net.loras), "Full (bias)": len(with_bias)}
    assert s.rank is None and s.alpha is None
    assert {m.key for m in s.modules} == {f"{m.lora_name}.weight" for m in net.loras} | \
        {f"{name}.bias" for name in with_bias}


def test_reference_file_metadata_is_read(tmp_path):
    """SimpleTuner-style: the file made by create_lycoris, with its config in `lycoris_config`."""
    config = {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16,
              "apply_preset": {"target_module": ["Attention", "FeedForward"]}}
    path, _net = reference_file(tmp_path, "lokr", metadata={"lycoris_config": json.dumps(config)})
    s = summarize(path)
    assert s.lycoris_config == config and s.metadata_count == 1


# --- key styles written by hand -------------------------------------------------------------------------------------

SD_UNET = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_"
SDXL_UNET = "lora_unet_input_blocks_4_1_transformer_blocks_1_"


@pytest.mark.parametrize("name,sd,inferred", [
    # kohya SD1/SD2 (diffusers UNet names): the same names, told apart by the text context attn2.to_k reads
    ("sd1", {**lora(SD_UNET + "attn1_to_q", 320, 320), **lora(SD_UNET + "attn2_to_k", 320, 768),
             **lora("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)}, "SD1.x"),
    ("sd2", {**lora(SD_UNET + "attn1_to_q", 320, 320), **lora(SD_UNET + "attn2_to_k", 320, 1024),
             **lora("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 1024, 1024)}, "SD2.x"),
    # ldm UNet names (sd-scripts SDXL) with only the context width to go by
    ("sdxl-width", {**lora("lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k", 640, 2048)}, "SDXL"),
    # kohya SDXL: two text encoders, a second transformer block in input_blocks 7/8
    ("sdxl-te2", {**lora("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 768, 768),
                  **lora("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 1280, 1280)}, "SDXL"),
    ("sdxl-blocks", {**lora("lora_unet_input_blocks_7_1_transformer_blocks_3_attn1_to_q", 1280, 1280)}, "SDXL"),
    # a UNet whose attn2.to_k is not in the file: a UNet, but which one the names cannot say
    ("unet", {**lora(SD_UNET + "attn1_to_q", 320, 320)}, "SD (UNet)"),
    ("unet-ldm", {**lora("lora_unet_middle_block_1_proj_in", 1280, 1280, kernel=(1, 1))}, "SD (UNet)"),
    # Flux (sd-scripts names of the BFL modules), SD3 (joint blocks), Wan, Qwen-Image
    ("flux", {**lora("lora_unet_double_blocks_0_img_attn_qkv", 96, 32),
              **lora("lora_unet_single_blocks_0_linear1", 64, 32)}, "Flux"),
    ("sd3", {**lora("lora_unet_joint_blocks_0_x_block_attn_qkv", 96, 32),
             **lora("lora_unet_joint_blocks_0_context_block_mlp_fc1", 64, 32)}, "SD3"),
    ("wan", {**peft("diffusion_model.blocks.0.cross_attn.k", 32, 32)}, "Wan"),
    ("qwen", {**peft("transformer.transformer_blocks.0.img_mlp.net.0.proj", 64, 32)}, "Qwen-Image"),
    # diffusers/PEFT SD1.5 (unet. prefix, lora_A/lora_B)
    ("peft-sd1", {**peft("unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k", 320, 768)}, "SD1.x"),
    # text encoder only: nothing to go by
    ("te-only", {**lora("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)}, None),
])
def test_family_inferred_from_key_names(name, sd, inferred, tmp_path):
    s = summarize(write(tmp_path / f"{name}.safetensors", sd))
    assert s.base_model == {"declared": None, "inferred": inferred}
    assert s.module_count == len([k for k in sd if k.endswith(("lora_up.weight", "lora_B.weight"))])


@pytest.mark.parametrize("prefix,family", [
    ("transformer.blocks.0.attn1.to_q", "Wan"),  # diffusers / SimpleTuner
    ("lycoris_blocks_0_attn2_add_k_proj", "Wan"),  # LyCORIS wrapper, I2V
    ("blocks.0.self_attn.q", "Wan"),  # DiffSynth-Studio, original names
    ("transformer.transformer_blocks.0.attn1.to_q", None),  # LTX-Video, Mochi and CogVideoX all write this
    ("lora_unet_layers_0_attention_to_q", "Z-Image / Lumina 2"),  # musubi-tuner
    ("diffusion_model.layers.0.attention.qkv", "Z-Image / Lumina 2"),  # ComfyUI's trainer, sd-scripts
])
def test_infer_family_of_video_and_newest_dits(prefix, family):
    assert infer_family({prefix: 64}) == family


def test_z_image_files_are_the_family_of_comfyuis_z_image_and_lumina2_models():
    assert family_id("Z-Image / Lumina 2") == family_id("ZImage") == family_id("Lumina2") == "lumina"


def test_infer_family_directly():
    assert infer_family({}) is None
    assert infer_family({"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k": 2048}) == "SDXL"
    # a width no SD family has: still a UNet
    assert infer_family({"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k": 512}) == "SD (UNet)"
    # a module whose input width the file does not pin (e.g. (IA)³ on the output) does not break the width rule
    assert infer_family({"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k": None}) == "SD (UNet)"


def test_hunyuan_video_keys_are_not_flux():
    """ComfyUI-format HunyuanVideo keys (`img_attn_qkv`, `img_mlp.fc1`, `img_mod.linear`) are unambiguous — Flux
    writes `img_attn.qkv`, `img_mlp.0`, `img_mod.lin` — yet FAMILY_PATTERNS lists Flux's `(img|txt)_(attn|mlp|mod)`
    first, so no key ever reaches the HunyuanVideo entry and the verdict would say 'made for Flux'."""
    hunyuan = {"diffusion_model.double_blocks.0.img_attn_qkv": 3072, "diffusion_model.double_blocks.0.img_mlp.fc1": 3072,
               "diffusion_model.double_blocks.0.img_mod.linear": 3072, "diffusion_model.single_blocks.0.linear1": 3072}
    assert infer_family(hunyuan) == "HunyuanVideo"


def test_simpletuner_file(tmp_path):
    """create_lycoris' `lycoris_` prefix over diffusers names, LoKr, config in `lycoris_config`."""
    config = {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 4}
    sd = {}
    for i, target in enumerate(["transformer_blocks_0_attn_to_q", "transformer_blocks_0_attn_to_k",
                                "single_transformer_blocks_0_proj_out"]):
        sd[f"lycoris_{target}.lokr_w1"] = rand(4, 4, seed=i)
        sd[f"lycoris_{target}.lokr_w2"] = rand(8, 16, seed=i + 10)
        sd[f"lycoris_{target}.alpha"] = torch.tensor(10000.0)
    s = summarize(write(tmp_path / "st.safetensors", sd, {"lycoris_config": json.dumps(config)}))
    assert s.algorithms == {"LoKr": 3}
    assert s.rank is None  # both factors full (linear_dim 10000 = "full matrix" in SimpleTuner configs)
    assert s.alpha == {"min": 10000.0, "max": 10000.0}
    assert s.params == 3 * (16 + 128)
    assert s.lycoris_config == config
    assert s.base_model["declared"] is None and s.unused_keys == 0


def test_peft_file_with_dora_magnitude(tmp_path):
    prefix = "transformer.single_transformer_blocks.0.proj_out"
    sd = {**peft(prefix, 32, 48, rank=6), f"{prefix}.lora_magnitude_vector": rand(32, seed=5) + 1,
          **peft("transformer.transformer_blocks.0.attn.to_q", 32, 32, rank=6, seed=9)}
    s = summarize(write(tmp_path / "peft.safetensors", sd))
    assert s.algorithms == {"LoRA+DoRA": 1, "LoRA": 1}  # PEFT LoRA on Linear layers
    assert s.rank == {"min": 6, "max": 6} and s.alpha is None  # PEFT keeps alpha in adapter_config.json
    assert s.dora_axis == "out"
    assert s.params == 6 * 48 + 32 * 6 + 32 + 6 * 32 + 32 * 6
    assert {m.key for m in s.modules} == {f"{prefix}.weight", "transformer.transformer_blocks.0.attn.to_q.weight"}


def test_kohya_conv_tucker_and_dtypes(tmp_path):
    """A kohya LoCon with a 3×3 conv (rank 8, tucker lora_mid), a Linear (rank 4) and mixed tensor dtypes."""
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    sd = {f"{conv}.lora_down.weight": rand(8, 320, 1, 1, seed=1).half(),
          f"{conv}.lora_mid.weight": rand(8, 8, 3, 3, seed=2).half(),
          f"{conv}.lora_up.weight": rand(320, 8, 1, 1, seed=3).half(),
          f"{conv}.alpha": torch.tensor(4.0, dtype=torch.float16),
          **lora(SD_UNET + "attn1_to_q", 320, 320, rank=4, alpha=1.0),
          f"{SD_UNET}ff_net_2.lora_down.weight": rand(2, 1280, seed=4).bfloat16(),
          f"{SD_UNET}ff_net_2.lora_up.weight": rand(320, 2, seed=5).bfloat16()}  # no alpha: alpha = rank
    path = write(tmp_path / "kohya.safetensors", sd)
    s = summarize(path)
    assert s.module_count == 3 and s.algorithms == {"LoCon": 1, "LoRA": 2}  # the 3×3 conv is LoCon, Linears LoRA
    assert s.tucker is True
    assert s.rank == {"min": 2, "max": 8} and s.conv_rank == {"min": 8, "max": 8}
    assert s.alpha == {"min": 1.0, "max": 4.0}  # the module without alpha has none to report
    assert s.dtypes == header_dtypes(path) == {"F16": 4, "F32": 3, "BF16": 2}
    assert s.params == sum(t.numel() for k, t in sd.items() if not k.endswith("alpha"))
    by_key = {m.key: m for m in s.modules}
    assert by_key[f"{conv}.weight"].tucker and by_key[f"{conv}.weight"].conv
    assert by_key[f"{SD_UNET}ff_net_2.weight"].alpha is None


def test_unknown_and_damaged_keys_are_counted_not_fatal(tmp_path):
    sd = {**lora(SD_UNET + "attn1_to_q", 320, 320),
          "lora_unet_something.some_unknown_suffix": torch.ones(3),  # no algorithm reads it
          # lora_up does not fit lora_down (rank 4 vs 3): a damaged module, both of its keys unused
          f"{SD_UNET}attn1_to_k.lora_up.weight": rand(320, 4, seed=1),
          f"{SD_UNET}attn1_to_k.lora_down.weight": rand(3, 320, seed=2)}
    s = summarize(write(tmp_path / "partly.safetensors", sd))
    assert s.module_count == 1 and s.unused_keys == 3


# --- metadata ------------------------------------------------------------------------------------------------------

TAGS = {"10_cat": {"cat": 40, "sitting": 12, " whiskers ": 7, "lycocat": 3}, "5_dog": {"dog": 25, "sitting": 20}}


def test_metadata_declared_family_title_training_and_trigger_words(tmp_path):
    metadata = {
        "ss_base_model_version": "sd_v1", "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.title": "Cat style", "ss_output_name": "cat_v3", "modelspec.trigger_phrase": "lycocat, cat style",
        "ss_tag_frequency": json.dumps(TAGS), "ss_network_module": "lycoris.kohya", "ss_network_dim": "4",
        "ss_network_alpha": "2.0", "ss_steps": "1200", "ss_seed": "42", "modelspec.author": "someone",
    }
    s = summarize(write(tmp_path / "meta.safetensors", lora(SD_UNET + "attn2_to_k", 320, 768), metadata))
    assert s.base_model == {"declared": "sd_v1", "inferred": "SD1.x"}
    assert s.title == "Cat style"
    # trigger phrase first (in its order), then tags by total count over the datasets, stripped, no repeats
    assert s.trigger_words == ["lycocat", "cat style", "cat", "sitting", "dog", "whiskers"]
    assert s.training == {"base model": "sd_v1", "network module": "lycoris.kohya", "dim": "4", "alpha": "2.0",
                          "steps": "1200", "output name": "cat_v3", "architecture": "stable-diffusion-v1/lora",
                          "title": "Cat style",
                          "author": "someone"}
    assert s.metadata_count == len(metadata)
    text = s.text()
    assert text.startswith("Cat style: 1 modules (LoRA ×1), rank 4, alpha 2")
    assert "base model: sd_v1 (declared), SD1.x (from key names)" in text
    assert "trigger words: lycocat, cat style, cat, sitting, dog, whiskers" in text


def test_declared_family_precedence():
    assert declared_family({}) is None
    assert declared_family({"modelspec.architecture": "flux-1-dev/lora"}) == "flux-1-dev/lora"
    assert declared_family({"ss_base_model_version": "sdxl_base_v1-0",
                            "modelspec.architecture": "stable-diffusion-xl-v1-base/lora"}) == "sdxl_base_v1-0"
    assert declared_family({"ss_base_model_version": "", "modelspec.architecture": "chroma/lora"}) == "chroma/lora"


def test_title_falls_back_to_output_name(tmp_path):
    s = summarize(write(tmp_path / "t.safetensors", lora(SD_UNET + "attn1_to_q", 320, 320), {"ss_output_name": "x1"}))
    assert s.title == "x1" and s.text().startswith("x1: ")


def test_trigger_words_cap_and_order():
    many = {"d": {f"tag{i}": 100 - i for i in range(20)}}
    words = trigger_words({"modelspec.trigger_phrase": "tag3, zz", "ss_tag_frequency": json.dumps(many)})
    assert words == ["tag3", "zz", "tag0", "tag1", "tag2", "tag4", "tag5", "tag6"]  # 8 by default, tag3 once
    assert trigger_words({"ss_tag_frequency": json.dumps(many)}, top=3) == ["tag0", "tag1", "tag2"]
    assert trigger_words({}) == []
    assert trigger_words({"modelspec.trigger_phrase": " , a ,, b "}) == ["a", "b"]


@pytest.mark.parametrize("tag_frequency", [
    "{not json", "", "[1, 2, 3]", '"a string"', '{"d": ["cat", "dog"]}', '{"d": {"cat": "many", "dog": -2}}',
    '{"d": {"cat": 2.5}}', "null",
])
def test_broken_tag_frequency_does_not_crash(tag_frequency, tmp_path):
    metadata = {"ss_tag_frequency": tag_frequency, "modelspec.trigger_phrase": "ok"}
    s = summarize(write(tmp_path / "b.safetensors", lora(SD_UNET + "attn1_to_q", 320, 320), metadata))
    assert s.trigger_words == ["ok"] and s.module_count == 1


@pytest.mark.parametrize("config", ["{not json", "", "{'algo': 'lokr'}"])
def test_broken_lycoris_config_does_not_crash(config, tmp_path):
    s = summarize(write(tmp_path / "b.safetensors", lora(SD_UNET + "attn1_to_q", 320, 320),
                        {"lycoris_config": config}))
    assert s.lycoris_config is None and s.module_count == 1 and s.metadata_count == 1


# --- header only ---------------------------------------------------------------------------------------------------

def test_reads_no_tensor_data_but_alpha_and_on_input(tmp_path, monkeypatch):
    """A file whose big tensors are all NaN still summarises (loading refuses it), and the only tensors whose bytes
    are read are the alpha and on_input scalars."""
    sd = {**lora(SD_UNET + "attn1_to_q", 320, 320, rank=8, alpha=4.0),
          **lora("lora_unet_down_blocks_0_resnets_0_conv1", 320, 320, rank=4, alpha=1.0, kernel=(3, 3)),
          "lora_unet_down_blocks_0_resnets_0_conv2.weight": rand(320, seed=3),  # (IA)³, on_input = 0
          "lora_unet_down_blocks_0_resnets_0_conv2.on_input": torch.tensor(0.0)}
    nan = {k: torch.full_like(v, float("nan")) if v.numel() > 1 else v for k, v in sd.items()}
    path = write(tmp_path / "nan.safetensors", nan)
    with pytest.raises(LycorisError, match="NaN"):
        read(path)

    reads = []
    original = summary_module.SafetensorsFile.tensor
    monkeypatch.setattr(summary_module.SafetensorsFile, "tensor",
                        lambda self, key: reads.append(key) or original(self, key))
    s = summarize(path)
    assert sorted(reads) == sorted(k for k in sd if k.endswith((".alpha", ".on_input")))
    assert s.module_count == 3 and s.algorithms == {"LoRA": 1, "LoCon": 1, "(IA)³": 1}
    assert s.rank == {"min": 4, "max": 8} and s.alpha == {"min": 1.0, "max": 4.0}
    assert s.conv_rank == {"min": 4, "max": 4}
    assert s.params == sum(v.numel() for k, v in sd.items() if not k.endswith(("alpha", "on_input")))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_alpha_gives_valid_json(value, tmp_path):
    """A non-finite alpha makes its module damaged, as a shape error does: its three keys are counted in
    unused_keys, the warning names the alpha key and says the loader refuses the file, and the alpha range is the
    other module's, so the summary is strict JSON (bare `Infinity`/`NaN` tokens would break the browser's
    `response.json()` on /lycoris/info and the Info node's payload)."""
    sd = {**lora(SD_UNET + "attn1_to_q", 320, 320), **lora(SD_UNET + "attn1_to_k", 320, 320, alpha=1.0)}
    sd[f"{SD_UNET}attn1_to_q.alpha"] = torch.tensor(value)
    s = summarize(write(tmp_path / "bad_alpha.safetensors", sd))
    json.dumps(s.to_json(with_modules=True), allow_nan=False)
    assert s.module_count == 1 and s.unused_keys == 3 and s.alpha == {"min": 1.0, "max": 1.0}
    assert [m.key for m in s.modules] == [f"{SD_UNET}attn1_to_k.weight"]
    warning = f"1 damaged module: the loader refuses this file ('{SD_UNET}attn1_to_q.alpha': alpha is NaN or Inf)"
    assert s.warnings == [warning]


@pytest.mark.parametrize("config,kept", [
    ('{"algo": "lokr", "factor": 8}', {"algo": "lokr", "factor": 8}),
    ('{"algo": "lokr", "factor": 1E400}', None),  # the case the strict fuzz check found: float("1E400") is inf
    ('{"algo": "lokr", "dropout": NaN}', None),
    ('{"algo": "lokr", "dropout": -Infinity}', None),
    ('{"algo": "lokr", "factor": 10000000000000000000000000000}', {"algo": "lokr", "factor": 10**28}),
])
def test_metadata_json_with_a_number_json_cannot_write_is_left_out(config, kept, tmp_path):
    """Metadata JSON is read as Python reads JSON, which takes NaN, Infinity and 1E400 (inf); the summary is served
    as strict JSON (/lycoris/info, the Info node's payload), so such a value is left out like unreadable JSON, and the
    file still reads."""
    sd = lora(SD_UNET + "attn1_to_q", 320, 320)
    s = summarize(write(tmp_path / "config.safetensors", sd, {"lycoris_config": config}))
    json.dumps(s.to_json(with_modules=True), allow_nan=False)
    assert s.lycoris_config == kept and s.module_count == 1


# --- block_of ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,block", [
    # SD UNet (ldm names)
    ("diffusion_model.input_blocks.4.1.proj_in.weight", "input_blocks.4"),
    ("diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight", "input_blocks.1"),
    ("diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight", "middle_block.1"),
    ("diffusion_model.output_blocks.11.0.in_layers.2.weight", "output_blocks.11"),
    ("diffusion_model.time_embed.0.weight", "time_embed.0"),
    ("diffusion_model.out.2.weight", "out.2"),
    ("diffusion_model.input_blocks.1.1.proj_in.bias", "input_blocks.1"),
    # Flux, SD3/DiT, Wan
    ("diffusion_model.double_blocks.3.img_attn.qkv.weight", "double_blocks.3"),
    ("diffusion_model.single_blocks.37.linear1.weight", "single_blocks.37"),
    ("diffusion_model.joint_blocks.12.x_block.attn.qkv.weight", "joint_blocks.12"),
    ("diffusion_model.blocks.12.cross_attn.k.weight", "blocks.12"),
    ("diffusion_model.final_layer.linear.weight", "final_layer"),
    # text encoders: te.<encoder>.<container>.<n>
    ("clip_l.transformer.text_model.encoder.layers.5.self_attn.q_proj.weight", "te.clip_l.layers.5"),
    ("clip_g.transformer.text_model.encoder.layers.31.mlp.fc2.weight", "te.clip_g.layers.31"),
    ("t5xxl.transformer.encoder.block.3.layer.0.SelfAttention.q.weight", "te.t5xxl.block.3"),
    ("clip_g.transformer.text_projection.weight", "te.clip_g"),
    ("clip_l.transformer.text_model.embeddings.token_embedding.weight", "te.clip_l"),
    # an architecture nobody wrote rules for: its top-level numbered container, else its first name
    ("diffusion_model.stages.2.mixers.7.in_proj.weight", "stages.2"),
    ("diffusion_model.patch_embedder.proj.weight", "patch_embedder"),
    ("qwen3.model.layers.20.mlp.up_proj.weight", "te.qwen3.layers.20"),
])
def test_block_of(key, block):
    assert block_of(key) == block


def test_conv_rank_is_known_only_where_the_file_keeps_kernel_dims(tmp_path):
    """A LoHa file trained with conv_dim 2 / linear_dim 8 stores its conv factors flattened 2-D (r, in·k·k): from the
    header alone nothing marks them as conv, so `conv_rank` stays None (documented in LycorisInfo.md) instead of
    guessing; a LoCon file keeps the kernel dims and reports its conv rank."""
    path, net = reference_file(tmp_path, "loha", linear_dim=8, conv_dim=2)
    conv_ranks = [m.lora_dim for m in net.loras if factory.LAYER[factory.layer_of(m.lora_name)].kind == "conv"]
    assert sorted(set(conv_ranks)) == [2, 8]
    assert summarize(path).conv_rank is None
    locon_path, locon_net = reference_file(tmp_path, "locon", linear_dim=8, conv_dim=2)
    locon_conv = [m.lora_dim for m in locon_net.loras
                  if factory.LAYER[factory.layer_of(m.lora_name)].kind == "conv" and m.lora_down.weight.ndim > 2]
    assert locon_conv and summarize(locon_path).conv_rank == span(locon_conv)
