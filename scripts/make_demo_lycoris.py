"""Write the demo LyCORIS files with the reference lycoris-lora 4.1.3 over the tiny SD1.5.

- ``demo_lokr_dora.safetensors`` (``write_demo_lycoris``): LoKr + DoRA over the UNet.
- ``demo_loha_te.safetensors`` (``write_demo_loha``): LoHa over the UNet and the CLIP-L text encoder, the second file
  the stack, schedule and block-weight examples need.

The networks are created on the UNetModel (and CLIP-L) that ComfyUI itself loads from the tiny checkpoint, so the
module names are ComfyUI's ldm names; with the ``lora_unet`` prefix they become ``lora_unet_<ldm key, . -> _>``,
which ``comfy.lora.model_lora_keys_unet`` maps for every ``diffusion_model.X.weight``, and with ``lora_te`` over
CLIP-L's ``transformer`` they are kohya's ``lora_te_text_model_encoder_layers_<i>_<layer>``, which
``comfy.lora.model_lora_keys_clip`` maps.

Freshly created adapters are a no-op (one factor starts at zero), so every parameter is filled with seeded
random values and the zero-started factor is then scaled so that each layer's delta is a fixed fraction of
its weight: small, but it visibly changes the image.

Each file carries its own version (``DEMO_VERSION``, ``LOHA_VERSION``): bump only the one whose tensors change, so
cached copies of the other stay valid and it keeps its tensors and metadata. (Byte for byte the files are not
reproducible: safetensors writes the metadata entries in an order that changes from run to run.)

CLI: ``python scripts/make_demo_lycoris.py OUT.safetensors --checkpoint tiny_sd15.safetensors [--kind loha]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_tiny_sd15
from comfy_env import setup_comfy

DEMO_VERSION = "1"
VERSION_KEY = "lycoris_nodes.demo_lycoris.version"
SEED = 4242
# |delta W| / |W| per layer: the image changes visibly, sampling stays sane.
RELATIVE_DELTA = 0.3
# DoRA magnitudes start at the weight's row norms; a ~10% random change makes them matter too.
DORA_SCALE_JITTER = 0.1

NETWORK_KWARGS = {"linear_dim": 8, "linear_alpha": 4, "algo": "lokr", "factor": 4, "dora_wd": True}
PRESET = {
    "enable_conv": True,
    # ComfyUI's ldm class names: the attention/ff Linears and proj_in/out live in SpatialTransformer,
    # the 3x3 convs and the time-embedding Linear in ResBlock.
    "target_module": ["SpatialTransformer", "ResBlock"],
    "target_name": [],
    "lora_prefix": "lora_unet",
}


def demo_metadata(kwargs: dict, network_args: dict, title: str, trigger: str) -> dict[str, str]:
    """kohya/modelspec metadata as sd-scripts writes it (values are strings), for the inspector to read back."""
    return {
        "ss_network_module": "lycoris.kohya",
        "ss_network_dim": str(kwargs["linear_dim"]),
        "ss_network_alpha": str(kwargs["linear_alpha"]),
        "ss_network_args": json.dumps({**network_args, "preset": "demo"}),
        "ss_base_model_version": "sd_v1",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.implementation": "https://github.com/KohakuBlueleaf/LyCORIS",
        "modelspec.title": title,
        "modelspec.trigger_phrase": trigger,
    }


METADATA = demo_metadata(NETWORK_KWARGS, {"algo": "lokr", "factor": "4", "dora_wd": "True"},
                         "LyCORIS Nodes demo (LoKr + DoRA, random)", "lycodemo")

# The second file (demo_loha_te.safetensors): LoHa over the same UNet modules and CLIP-L's attention and MLP Linears.
LOHA_VERSION = "1"
LOHA_SEED = 4343
LOHA_KWARGS = {"linear_dim": 4, "linear_alpha": 2, "algo": "loha"}
TE_PRESET = {
    "enable_conv": False,
    # comfy.clip_model class names; the network is created on CLIP-L's `transformer` (a CLIPTextModel).
    "target_module": ["CLIPAttention", "CLIPMLP"],
    "target_name": [],
    "lora_prefix": "lora_te",
}
LOHA_METADATA = demo_metadata(LOHA_KWARGS, {"algo": "loha"},
                              "LyCORIS Nodes demo (LoHa, UNet + text encoder, random)", "lycoloha")


@dataclass(frozen=True)
class DemoSpec:
    """One demo file: the lycoris network(s) and the metadata it is saved with."""

    version: str
    seed: int
    network_kwargs: dict
    metadata: dict
    # (part, preset) per network; part "unet" is the diffusion model, "te" CLIP-L's transformer.
    networks: tuple[tuple[str, dict], ...]


LOKR_DORA = DemoSpec(DEMO_VERSION, SEED, NETWORK_KWARGS, METADATA, (("unet", PRESET),))
LOHA = DemoSpec(LOHA_VERSION, LOHA_SEED, LOHA_KWARGS, LOHA_METADATA, (("unet", PRESET), ("te", TE_PRESET)))
KINDS = {"lokr_dora": LOKR_DORA, "loha": LOHA}

_PRESET_ATTRS = (
    "ENABLE_CONV",
    "TARGET_REPLACE_MODULE",
    "TARGET_REPLACE_NAME",
    "LORA_PREFIX",
    "MODULE_ALGO_MAP",
    "NAME_ALGO_MAP",
    "USE_FNMATCH",
    "TARGET_EXCLUDE_NAME",
)


def _version(spec: DemoSpec = LOKR_DORA) -> str:
    # The DoRA magnitudes (and every delta's size) are taken from the checkpoint's weights: a new checkpoint means
    # new files.
    return f"{spec.version}+tiny_sd15.{make_tiny_sd15.GENERATOR_VERSION}"


def _load_models(checkpoint: Path, with_clip: bool = False):
    """ComfyUI's BaseModel for the checkpoint and, with_clip, its CLIP (else None); the VAE is not needed."""
    setup_comfy()
    import comfy.sd

    patcher, clip = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=False, output_clip=with_clip)[:2]
    return patcher.model, clip


def _load_unet_model(checkpoint: Path):
    """ComfyUI's BaseModel for the checkpoint (UNet only; CLIP and VAE are not needed)."""
    return _load_models(checkpoint)[0]


def _create_network(root, preset: dict = PRESET, network_kwargs: dict = NETWORK_KWARGS):
    """create_lycoris with our preset; the preset is class-global in lycoris, so restore it afterwards."""
    from lycoris import LycorisNetwork, create_lycoris

    prefix = preset["lora_prefix"]
    saved = {name: getattr(LycorisNetwork, name) for name in _PRESET_ATTRS}
    try:
        LycorisNetwork.apply_preset(preset)
        # create_lycoris applies its default "full" preset too; in 4.1.3 that only sets enable_conv
        # (its unet_* keys are not read by apply_preset), so our targets and prefix survive. Checked below.
        net = create_lycoris(root, 1.0, **network_kwargs)
    finally:
        for name, value in saved.items():
            setattr(LycorisNetwork, name, value)
    if not net.loras or any(not lora.lora_name.startswith(f"{prefix}_") for lora in net.loras):
        raise RuntimeError(f"lycoris did not create {prefix}_* modules; did create_lycoris override the preset?")
    net.apply_to()  # registers the modules on the network, so state_dict() sees them
    return net


def _randomise(net, seed: int = SEED) -> None:
    import torch

    with torch.no_grad():
        for lora in net.loras:
            zero_started = []
            for name, param in lora.named_parameters():
                gen = torch.Generator().manual_seed(seed ^ zlib.crc32(f"{lora.lora_name}.{name}".encode()))
                noise = torch.randn(param.shape, generator=gen)
                if name == "dora_scale":
                    param.mul_(1 + DORA_SCALE_JITTER * noise)
                    continue
                if not param.any():
                    zero_started.append(param)
                param.copy_(noise / param.shape[-1] ** 0.5)
            if not zero_started:
                raise RuntimeError(f"{lora.lora_name}: no zero-initialised factor to calibrate")
            weight = lora.org_module[0].weight
            # get_weight() is the delta the training forward (and every UI) applies, alpha/r included once;
            # 4.1.3's LoKr get_diff_weight() applies alpha/r a second time, so it is not used here.
            diff = lora.get_weight(weight.shape)
            # The delta is linear in the zero-started factor: rescale it to hit the target ratio exactly.
            factor = RELATIVE_DELTA * weight.float().norm() / diff.float().norm()
            for param in zero_started:
                param.mul_(factor)


def _networks(spec: DemoSpec, checkpoint: Path) -> list:
    model, clip = _load_models(checkpoint, with_clip=any(part == "te" for part, _ in spec.networks))
    roots = {"unet": model.diffusion_model, "te": clip.cond_stage_model.clip_l.transformer if clip else None}
    nets = []
    for part, preset in spec.networks:
        net = _create_network(roots[part], preset, spec.network_kwargs)
        _randomise(net, spec.seed)
        nets.append(net)
    return nets


def _save(nets: list, path: Path, metadata: dict) -> None:
    """As LycorisNetwork.save_weights (fp16 safetensors) but for the modules of several networks in one file."""
    import torch
    from safetensors.torch import save_file

    if len(nets) == 1:  # the reference's own writer, as the first demo file has always been written
        nets[0].save_weights(str(path), torch.float16, metadata)
        return
    state_dict = {}
    for net in nets:
        for key, value in net.state_dict().items():
            if key in state_dict:
                raise RuntimeError(f"two networks both write {key}")
            state_dict[key] = value.detach().clone().to("cpu").to(torch.float16)
    save_file(state_dict, str(path), metadata)


def _write(spec: DemoSpec, path: str | Path, checkpoint: str | Path, force: bool) -> Path:
    path = Path(path)
    if not force and existing_version(path) == _version(spec):
        return path
    nets = _networks(spec, Path(checkpoint))
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own (test workers write the cache at once); save_weights picks the format by extension.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.safetensors")
    _save(nets, tmp, {**spec.metadata, VERSION_KEY: _version(spec)})
    tmp.replace(path)
    return path


def existing_version(path: Path) -> str | None:
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get(VERSION_KEY)


def write_demo_lycoris(path: str | Path, checkpoint: str | Path, force: bool = False) -> Path:
    """Write the demo file to ``path`` (skipped if the same version exists); ``checkpoint`` is the tiny SD1.5."""
    return _write(LOKR_DORA, path, checkpoint, force)


def write_demo_loha(path: str | Path, checkpoint: str | Path, force: bool = False) -> Path:
    """Write the second demo file (LoHa, UNet + text encoder) to ``path``, skipped if the same version exists."""
    return _write(LOHA, path, checkpoint, force)


def verify(path: str | Path, checkpoint: str | Path) -> int:
    """Every key must map through ComfyUI's own key map and be consumed by comfy.lora.load_lora (core ComfyUI,
    not this pack), on the checkpoint ComfyUI detects as SD15. Returns the number of patched weights.
    Text-encoder keys (``lora_te_*``) are mapped with the checkpoint's CLIP.
    """
    import comfy.lora
    import comfy.utils

    lora = comfy.utils.load_torch_file(str(path), safe_load=True)
    with_clip = any(key.startswith("lora_te") for key in lora)
    model, clip = _load_models(Path(checkpoint), with_clip=with_clip)
    if type(model.model_config).__name__ != "SD15":
        raise RuntimeError(f"{checkpoint} detected as {type(model.model_config).__name__}, expected SD15")
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    if with_clip:
        key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
    prefixes = {key.split(".", 1)[0] for key in lora}
    unmapped = sorted(p for p in prefixes if p not in key_map)
    if unmapped:
        raise RuntimeError(f"{len(unmapped)} prefixes not in ComfyUI's key map, e.g. {unmapped[:3]}")

    warnings = _LogCollector()
    logging.getLogger().addHandler(warnings)
    try:
        patches = comfy.lora.load_lora(lora, key_map)
    finally:
        logging.getLogger().removeHandler(warnings)
    not_loaded = [m for m in warnings.messages if "not loaded" in m.lower()]
    if not_loaded:
        raise RuntimeError(f"ComfyUI left keys unloaded: {not_loaded[:3]}")
    if len(patches) != len(prefixes):
        raise RuntimeError(f"{len(prefixes)} modules in the file but ComfyUI made {len(patches)} patches")
    return len(patches)


class _LogCollector(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True, help="tiny SD1.5 (written if missing)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="lokr_dora",
                        help="lokr_dora: LoKr + DoRA over the UNet (default); loha: LoHa over the UNet and CLIP-L")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--no-verify", action="store_true")
    opts = parser.parse_args(argv)

    make_tiny_sd15.write_tiny_sd15(opts.checkpoint)
    start = time.perf_counter()
    _write(KINDS[opts.kind], opts.out, opts.checkpoint, force=opts.force)
    print(f"{opts.out}: {opts.out.stat().st_size / 1e6:.1f} MB, ready in {time.perf_counter() - start:.1f} s")
    if not opts.no_verify:
        print(f"ComfyUI maps and loads all of it: {verify(opts.out, opts.checkpoint)} patched weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
