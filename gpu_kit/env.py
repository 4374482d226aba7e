"""ComfyUI and the pack made importable in a check process, on the real GPU or (dry run) on the CPU.

The pack is imported the way ComfyUI names it (`lycoris_nodes`), but without running its `__init__.py`: that file
registers the node classes, whose API module (comfy_api) imports PyAV and torchaudio for video and audio nodes. The
checks call the code those nodes call (nodes/glue/apply.py `apply_file`, what LyCORIS Loader runs after reading its
inputs), so the kit does not carry 35 MB of video codecs it never uses.
"""

import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

PACK_NAME = "lycoris_nodes"


@dataclass(frozen=True)
class Env:
    dry_run: bool
    device: "object"  # torch.device: cuda:0, or cpu in a dry run
    dynamic_vram: bool  # comfy-aimdo's dynamic VRAM initialised in this process
    why_not_dynamic: str  # why not, when it is not


def _init_aimdo_early() -> str | None:
    """comfy-aimdo's allocator hooks, as main.py installs them before CUDA is used; the reason when it cannot."""
    try:
        import comfy_aimdo.control
    except ImportError as e:
        return f"comfy-aimdo is not importable: {e}"
    for kwargs in ({"simple_vram_headroom": None, "nvml_pressure": True}, {"simple_vram_headroom": None}, {}):
        try:  # the protocols of 0.4.11+, 0.4.10 and 0.4.9, as main.py tries them
            comfy_aimdo.control.init(**kwargs)
            return None
        except TypeError:
            continue
    return "comfy_aimdo.control.init() accepts none of the known protocols"


def _enable_dynamic_vram() -> str | None:
    """What main.py does once ComfyUI picked its devices: comfy-aimdo on every device, ModelPatcherDynamic as the
    core patcher, aimdo_enabled. Returns the reason when it cannot."""
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy_aimdo.control
    from comfy.cli_args import args

    if not comfy.model_management.is_nvidia():
        return "dynamic VRAM is ComfyUI's default on NVIDIA GPUs only"
    if comfy.model_management.torch_version_numeric < (2, 8):
        return "dynamic VRAM needs PyTorch 2.8 or newer"
    devices = comfy.model_management.get_all_torch_devices()
    headroom = int((getattr(args, "vram_headroom", 0) or 0) * 1024 ** 3)
    try:
        ok = comfy_aimdo.control.init_devices((d.index, headroom) for d in devices)
    except TypeError:  # comfy-aimdo 0.4.9's protocol, as main.py falls back to it
        ok = comfy_aimdo.control.init_devices(d.index for d in devices)
    if not ok:
        return "comfy_aimdo.control.init_devices() found no working device"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return None


def setup(comfyui: Path, pack: Path, dry_run: bool, dynamic: bool = False) -> Env:
    """ComfyUI first on sys.path, its arguments unparsed (CPU mode in a dry run), the pack as `lycoris_nodes`."""
    comfyui, pack = Path(comfyui).resolve(), Path(pack).resolve()
    sys.path.insert(0, str(comfyui))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    why_not = "not asked for"
    if dry_run:
        args.cpu = True
        # The attention ComfyUI picks on an NVIDIA GPU (PyTorch's SDPA, its default there since torch 2), not the
        # CPU's sub-quadratic one, which asks psutil for the free memory in every call: under torch.compile each of
        # those calls is a graph break (18 graphs instead of 1 for the dry run's Flux, and 3x its tracing time).
        args.use_pytorch_cross_attention = True
        if dynamic:
            why_not = "dry run: dynamic VRAM needs comfy-aimdo on an NVIDIA GPU"
    elif dynamic:
        why_not = _init_aimdo_early()
    import comfy.model_management
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the real run needs an NVIDIA GPU (use --dry-run to try the kit on a CPU)")
    if dynamic and not dry_run and why_not is None:
        why_not = _enable_dynamic_vram()
    _import_pack(pack)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger(PACK_NAME).setLevel(logging.ERROR)  # its expected warnings (fp8 merges...): the report says it
    device = torch.device("cpu") if dry_run else comfy.model_management.get_torch_device()
    return Env(dry_run=dry_run, device=device, dynamic_vram=dynamic and why_not is None,
               why_not_dynamic="" if why_not is None else why_not)


def _import_pack(pack: Path) -> None:
    if PACK_NAME in sys.modules:
        return
    spec = importlib.machinery.ModuleSpec(PACK_NAME, None, is_package=True)
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(pack)]
    sys.modules[PACK_NAME] = module
