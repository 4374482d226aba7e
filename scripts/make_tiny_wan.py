"""Write a tiny Wan 2.2 A14B stand-in for the e2e tests: two WAN21 text-to-video models (the high-noise and the
low-noise expert, other seeds) that ComfyUI's Load Diffusion Model detects as Wan, and a HIGH/LOW LoRA pair for them
written by the reference lycoris-lora 4.1.3 (LoHa).

- Models: ComfyUI's own WanModel at width 128 (one 128-wide head: detection reads num_heads = dim // 128), two
  blocks, ffn 256, the real text (4096) and frequency (256) widths; seeded random weights scaled by 1/sqrt(fan_in),
  stored fp16 under the original Wan key names, as Comfy-Org's repackaged files are. About 2M parameters.
- LoRAs: LoHa over each block's attention and feed-forward Linears, prefix ``lora_unet`` (ComfyUI maps
  ``lora_unet_<key, . -> _>`` for every ``diffusion_model.<key>.weight``; musubi-tuner's networks/lora_wan.py names
  its Wan LoRAs the same way), randomised as scripts/make_demo_lycoris.py does, each with its own seed and the
  training metadata musubi-tuner writes for its expert (``ss_sd_model_name``: the expert's base model file).

CLI: ``python scripts/make_tiny_wan.py FOLDER`` writes the four files (FOLDER/diffusion_models, FOLDER/loras).
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_demo_lycoris
from comfy_env import setup_comfy

GENERATOR_VERSION = "1"
VERSION_KEY = "lycoris_nodes.tiny_wan.version"
CONFIG = {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "freq_dim": 256, "text_dim": 4096,
          "in_dim": 16, "out_dim": 16, "num_heads": 1, "num_layers": 2, "patch_size": (1, 2, 2),
          "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
EXPERTS = {"high": ("tiny_wan22_high_noise.safetensors", 101), "low": ("tiny_wan22_low_noise.safetensors", 202)}
LORAS = {"high": ("tiny_wan22_motion_HIGH.safetensors", 303), "low": ("tiny_wan22_motion_LOW.safetensors", 404)}
LORA_PRESET = {"enable_conv": False, "target_module": ["WanAttentionBlock"], "target_name": [],
               "lora_prefix": "lora_unet"}
LORA_KWARGS = {"linear_dim": 4, "linear_alpha": 4, "algo": "loha"}


def _model(seed: int):
    """ComfyUI's WAN21 at CONFIG with seeded weights (its layers are not initialised)."""
    setup_comfy()
    import comfy.supported_models
    import torch

    model_config = comfy.supported_models.WAN21_T2V(dict(CONFIG))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "", device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.diffusion_model.named_parameters():
            gen = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
            fan = param[0].numel() if param.ndim > 1 else 4
            param.copy_(torch.randn(param.shape, generator=gen) * fan ** -0.5)
    return model


def _current(path: Path) -> bool:
    from safetensors import safe_open

    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get(VERSION_KEY) == GENERATOR_VERSION


def _replace(path: Path, write) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.safetensors")  # test workers may write the cache at once
    write(tmp)
    tmp.replace(path)
    return path


def write_expert(path: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    model = _model(seed)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.diffusion_model.state_dict().items()}
    return _replace(path, lambda tmp: save_file(state, str(tmp), {VERSION_KEY: GENERATOR_VERSION}))


def write_lora(path: Path, expert_seed: int, seed: int, base_model_name: str) -> Path:
    network = make_demo_lycoris._create_network(_model(expert_seed).diffusion_model, LORA_PRESET, LORA_KWARGS)
    make_demo_lycoris._randomise(network, seed)
    metadata = {VERSION_KEY: GENERATOR_VERSION, "ss_sd_model_name": base_model_name, "ss_network_module": "networks.lora_wan",
                "modelspec.trigger_phrase": f"tiny wan {Path(path).stem.rsplit('_', 1)[-1].lower()}"}
    return _replace(path, lambda tmp: make_demo_lycoris._save([network], tmp, metadata))


def write_all(folder: str | Path) -> dict[str, list[Path]]:
    """The two experts (diffusion_models) and the LoRA pair (loras) under `folder`, reused when current."""
    folder = Path(folder)
    out: dict[str, list[Path]] = {"diffusion_models": [], "loras": []}
    for expert, (name, seed) in EXPERTS.items():
        path = folder / "diffusion_models" / name
        out["diffusion_models"].append(path if _current(path) else write_expert(path, seed))
        lora_name, lora_seed = LORAS[expert]
        lora = folder / "loras" / lora_name
        out["loras"].append(lora if _current(lora) else write_lora(lora, seed, lora_seed, name))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    for kind, paths in write_all(parser.parse_args(argv).folder).items():
        print(kind, *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
