"""What the pack's nodes share of ComfyUI's node interface: the category, the inputs every loader-like node takes
(model, clip, file, strengths, strength and apply modes, block weights) and how a node names its file and its
injection."""

import threading
from collections.abc import Iterable

import folder_paths
from comfy_api.latest import io

from . import lora_files
from .cache import file_identity
from .routing import MODES

CATEGORY = "loaders/lycoris"
STRENGTH_MODES = ["linear", "lycoris"]
STRENGTH_MODE_TOOLTIP = (
    "How strength acts on DoRA, OFT and BOFT files. 'linear': the change scales linearly with strength "
    "(0 = off, 1 = exactly the file, -1 = inverted). 'lycoris': LyCORIS' own multiplier semantics for those "
    "algorithms (identical at strength 1). Other algorithms behave the same in both modes."
)


def model_input() -> io.Model.Input:
    return io.Model.Input("model", tooltip="The diffusion model the file is applied to.")


def clip_input(optional: bool = False) -> io.Clip.Input:
    return io.Clip.Input("clip", optional=optional, tooltip="The text encoder the file is applied to.")


def model_clip_outputs() -> list:
    return [io.Model.Output(display_name="MODEL", tooltip="The patched diffusion model."),
            io.Clip.Output(display_name="CLIP", tooltip="The patched text encoder.")]


def lycoris_input() -> io.Combo.Input:
    return io.Combo.Input("lycoris_name", options=folder_paths.get_filename_list("loras"),
                          tooltip="The LyCORIS/LoRA file (.safetensors) from the loras folder.")


def strength_input(name: str, what: str) -> io.Float.Input:
    return io.Float.Input(name, default=1.0, min=-100.0, max=100.0, step=0.01,
                          tooltip=f"How strongly to change the {what}. 0 leaves it unchanged; negative inverts.")


def mode_input() -> io.Combo.Input:
    return io.Combo.Input("strength_mode", options=STRENGTH_MODES, default="linear", optional=True,
                          tooltip=STRENGTH_MODE_TOOLTIP)


# `auto` is exact on quantized layers and merges plain float layers exactly as `merge` does: a user who loads a
# quantized model gets the file as trained without knowing about apply modes, and nothing changes on other models.
DEFAULT_APPLY_MODE = "auto"
APPLY_MODE_TOOLTIP = (
    "'auto' (default) bypasses the layers a merge would re-round: fp8 and quantized (ComfyUI's scaled fp8 and "
    "comfy_quant layers), so the change is added in full precision and the result is the file as trained "
    "(measured on an fp8 model: about 1.1x the time of a step for LoRA/LoCon, 2x for DoRA); it merges every other "
    "layer as 'merge' does (an fp32 layer is bypassed too where ComfyUI would merge it through an fp16 copy), "
    "GGUF included (the GGUF pack patches the decoded weight, so that is exact). "
    "'merge' patches the weights: no cost per step, but on an fp8 or quantized layer ComfyUI rounds W+dW back to "
    "the stored format, which loses part of the change (6-50% measured, by format). 'bypass' leaves every "
    "Linear/Conv weight untouched and adds the adapter in the layer's forward: a strength change re-patches "
    "nothing. Bypassed changes cost time at every step and are not in the weights: use 'merge' for a model you "
    "save. Biases and norm layers are merged, except an fp8 bias in 'bypass' and 'auto': its change is added in "
    "the forward too."
)


def apply_mode_input() -> io.Combo.Input:
    return io.Combo.Input("apply_mode", options=list(MODES), default=DEFAULT_APPLY_MODE, optional=True,
                          tooltip=APPLY_MODE_TOOLTIP)


def node_key(node: type[io.ComfyNode]) -> str | None:
    """The node instance's id in the prompt: a bypass injection key that is stable across re-runs of this node
    and different from every other node's. None outside a prompt (then each call gets a fresh key)."""
    hidden = getattr(node, "hidden", None)
    return getattr(hidden, "unique_id", None)


def lycoris_path(lycoris_name: str) -> str:
    found = lora_files.full_path(lycoris_name)
    if found is None:  # ComfyUI's own error for a missing file
        return folder_paths.get_full_path_or_raise(lora_files.FOLDER, lycoris_name)
    return found


def file_stamp(lycoris_name) -> str:
    """The file's identity (cache.file_identity) as text: it changes when the file, or the adapter_config.json beside
    it, is rewritten."""
    path = lora_files.full_path(lycoris_name) if isinstance(lycoris_name, str) else None
    return "missing" if path is None else repr(file_identity(path))


def fingerprint_by_file(cls, lycoris_name=None, **_inputs) -> str:
    """A node's `fingerprint_inputs`: ComfyUI re-runs a node whose fingerprint changed even when its inputs did
    not, so a file rewritten under the same name (a retrained LoRA) is read and checked again on the next run
    instead of the old result being served from ComfyUI's cache."""
    return file_stamp(lycoris_name)


class LinkedFiles:
    """The files this process's nodes have applied from linked inputs (a rows node's lora_text or lora_stack, LyCORIS
    Apply Stack's lora_stack). ComfyUI computes a fingerprint before the links' values exist (execution.py
    IsChangedCache: linked inputs reach `fingerprint_inputs` as None), so without these a file named only there and
    rewritten under the same name (a retrained LoRA) would be served from ComfyUI's cache.

    Each file keeps the stamp it had when first applied and a count of the rewrites seen since. The fingerprint of
    every node that takes such links lists the files rewritten at least once with their counts: remembering a new file
    changes nothing (an unchanged workflow queued again stays cached), a rewrite changes every such node's fingerprint
    once (they run again; the others' files come from the file cache), and the count only grows, so a later
    fingerprint never equals one from before the rewrite (which an LRU cache could still hold)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, int]] = {}  # name -> (stamp, rewrites seen)
        self._lock = threading.Lock()  # prompts run on ComfyUI's worker thread, fingerprints are read beside them

    def add(self, names: Iterable[str]) -> None:
        with self._lock:
            for name in names:
                if name not in self._seen:
                    self._seen[name] = (file_stamp(name), 0)

    def rewrites(self) -> list[str]:
        """`name#count` of each remembered file rewritten since it was first applied, in name order."""
        with self._lock:
            for name, (stamp, count) in self._seen.items():
                now = file_stamp(name)
                if now != stamp:
                    self._seen[name] = (now, count + 1)
            return [f"{name}#{count}" for name, (_stamp, count) in sorted(self._seen.items()) if count]


LINKED_FILES = LinkedFiles()


def remember_linked(names: Iterable[str]) -> None:
    """Files a node is about to read and apply from a linked input (see LinkedFiles): called before they are read,
    so a rewrite in between counts as one."""
    LINKED_FILES.add(names)


def stamps_with_linked(names: Iterable[str]) -> str:
    """A node's fingerprint: file_stamp of each file named, then the rewrites of files remembered from links."""
    return "\n".join([*(file_stamp(name) for name in names), *LINKED_FILES.rewrites()])


def fingerprint_by_links(cls, **_inputs) -> str:
    """`fingerprint_inputs` of a node whose files all come from links (LyCORIS Apply Stack)."""
    return stamps_with_linked(())


BLOCK_WEIGHTS_TOOLTIP = (
    "Per-block multipliers on the strengths, by name: 'default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8'. "
    "Names are the model's own key paths ('*' is any one part, 'a-b' an index range, 'te' the text encoders); the last "
    "matching rule wins; 0 leaves a block untouched. A1111/Inspire LBW vectors (SD1.5: 17 or 26 numbers, SDXL: 12 or "
    "20) work too. LyCORIS Block Info lists the blocks a file touches."
)


def block_weights_input() -> io.String.Input:
    # Empty by default: a 'default=1' here would come after a preset's own 'default=…' and silently override it.
    return io.String.Input("block_weights", multiline=True, default="", tooltip=BLOCK_WEIGHTS_TOOLTIP)
