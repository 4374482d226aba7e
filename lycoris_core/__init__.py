"""LyCORIS maths and file handling, in plain torch + safetensors (no ComfyUI import).

    f = load("file.safetensors")                 # every module parsed and checked
    plan = f.modules[key].plan_for(W.shape)      # fits this weight? (LycorisError otherwise)
    apply(plan, f.modules[key].tensors, W, strength)   # W patched in place
"""

from .errors import LycorisError
from .lycoris_file import LycorisFile, UnusedKey, load, parse_state_dict
from .module import Module, Plan
from .patch import apply, change, change_norms
from .safetensors_file import SafetensorsFile

__all__ = [
    "LycorisError", "LycorisFile", "Module", "Plan", "SafetensorsFile", "UnusedKey",
    "apply", "change", "change_norms", "load", "parse_state_dict",
]
