"""Write a tiny but real SD1.5-layout checkpoint that ComfyUI loads and detects as SD15.

- UNet: ComfyUI's own UNetModel with model_channels 320 and context_dim 768 (what SD15 detection keys on) but a
  single level: channel_mult [1], one res block, transformer depth 1 (about 26M parameters, stored fp16).
- VAE: the TAESD layout under ``first_stage_model.taesd_*`` (about 2.5M parameters, fp16).
- CLIP: the standard SD1 CLIP-L text encoder (124M parameters, fixed size) stored as float8_e4m3fn so the
  file stays near 180 MB; ComfyUI casts it up at load.

Key names and shapes come from ComfyUI's classes built on the ``meta`` device; values are seeded random
tensors (per-key seeds, so the file does not depend on iteration order) scaled by 1/sqrt(fan_in) so the
activations and the sampler output stay finite.

CLI: ``python scripts/make_tiny_sd15.py OUT.safetensors [--force] [--no-verify]``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

from comfy_env import setup_comfy

if TYPE_CHECKING:
    import torch

# Bump when the tensors or layout change, so cached files get rewritten.
GENERATOR_VERSION = "1"
VERSION_KEY = "lycoris_nodes.tiny_sd15.version"
SEED = 20240501

UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "use_spatial_transformer": True,
    "legacy": False,
    "adm_in_channels": None,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [1],
    "channel_mult": [1],
    "transformer_depth": [1],
    "transformer_depth_output": [1, 1],
    "transformer_depth_middle": 1,
    "use_linear_in_transformer": False,
    "context_dim": 768,
    "num_heads": 8,
    "num_head_channels": -1,
    "use_temporal_attention": False,
    "use_temporal_resblock": False,
}


def _layout() -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint key -> (shape, stored dtype), built from ComfyUI's classes on the meta device."""
    setup_comfy()
    import comfy.ops
    import comfy.sd1_clip
    import comfy.taesd.taesd
    import torch
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    layout = {}
    unet = UNetModel(**UNET_CONFIG, device="meta", dtype=torch.float16, operations=comfy.ops.disable_weight_init)
    for k, v in unet.state_dict().items():
        layout[f"model.diffusion_model.{k}"] = (tuple(v.shape), torch.float16)
    with torch.device("meta"):
        vae = comfy.taesd.taesd.TAESD()
    for k, v in vae.state_dict().items():
        layout[f"first_stage_model.{k}"] = (tuple(v.shape), torch.float16)
    clip = comfy.sd1_clip.SD1ClipModel(device="meta")
    for k, v in clip.state_dict().items():
        # SD15.process_clip_state_dict maps cond_stage_model.* back to clip_l.* at load.
        name = "cond_stage_model." + k.removeprefix("clip_l.")
        # Scalars (logit_scale) stay fp32: fp8 is only worth it for the big matrices.
        layout[name] = (tuple(v.shape), torch.float8_e4m3fn if v.ndim >= 1 else torch.float32)
    return layout


def _value(name: str, shape: tuple[int, ...], dtype) -> torch.Tensor:
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("logit_scale"):
        return torch.full(shape, math.log(100.0), dtype=dtype)
    if name.endswith("vae_scale"):
        return torch.ones(shape, dtype=dtype)
    if leaf == "bias" or name.endswith("vae_shift"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        # GroupNorm/LayerNorm gains.
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(SEED ^ zlib.crc32(name.encode()))
    fan_in = math.prod(shape[1:])
    std = 0.02 if "embedding" in name else 1.0 / math.sqrt(fan_in)
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def existing_version(path: Path) -> str | None:
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get(VERSION_KEY)


def write_tiny_sd15(path: str | Path, force: bool = False) -> Path:
    """Write the checkpoint to ``path`` unless a file of the same generator version is already there."""
    path = Path(path)
    if not force and existing_version(path) == GENERATOR_VERSION:
        return path
    from safetensors.torch import save_file

    tensors = {name: _value(name, shape, dtype) for name, (shape, dtype) in _layout().items()}
    metadata = {
        VERSION_KEY: GENERATOR_VERSION,
        "modelspec.architecture": "stable-diffusion-v1",
        "modelspec.title": "tiny random SD1.5 (LyCORIS Nodes test fixture)",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # its own: test workers write the cache at once
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)  # atomic: a half-written file never carries the version tag
    return path


def verify(path: str | Path) -> str:
    """Load with ComfyUI's own loader; returns the detected model config name (must be SD15)."""
    setup_comfy()
    import comfy.sd

    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path))
    detected = type(model.model.model_config).__name__
    if detected != "SD15":
        raise RuntimeError(f"{path} detected as {detected}, expected SD15")
    if clip is None or vae is None:
        raise RuntimeError(f"{path}: ComfyUI found no CLIP or VAE in it")
    return detected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--force", action="store_true", help="rewrite even if the same version exists")
    parser.add_argument("--no-verify", action="store_true", help="skip loading it back with ComfyUI")
    opts = parser.parse_args(argv)

    start = time.perf_counter()
    write_tiny_sd15(opts.out, force=opts.force)
    size_mb = opts.out.stat().st_size / 1e6
    print(f"{opts.out}: {size_mb:.0f} MB, ready in {time.perf_counter() - start:.1f} s")
    if not opts.no_verify:
        start = time.perf_counter()
        print(f"ComfyUI detects it as {verify(opts.out)} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
