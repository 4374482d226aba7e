"""What the four tool nodes (Save, Resize, Extract, Convert) share: where they may write, their common inputs, the
progress bar, the device the maths runs on, and the report they return."""

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import comfy.model_management
import comfy.utils
import folder_paths
import psutil
import torch
from comfy_api.latest import io

from ...lycoris_core import LycorisError
from ...lycoris_core.tools import writer
from ...lycoris_core.tools.metadata import ModuleRecord

CATEGORY = "loaders/lycoris/tools"
MAX_LISTED = 20


# The dtypes a tool may write its tensors in; the error each tool reports is measured after this rounding.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_input(default: str = "fp16") -> io.Combo.Input:
    return io.Combo.Input("dtype", options=list(DTYPES), default=default,
                          tooltip="The dtype the file's tensors are written in. The reported error is measured "
                                  "after this rounding; fp32 keeps exact modes exact.")


def input_path(folder: str, name: str) -> str:
    """A file by its name in one of ComfyUI's folders (e.g. "loras", "checkpoints"), or by path (command line)."""
    found = folder_paths.get_full_path(folder, name)
    if found is not None:
        return found
    if Path(name).is_file():
        return str(Path(name).resolve())
    raise LycorisError(f"no such file in the {folder} folder, nor as a path", file=name)


def checkpoint(name: str, with_clip: bool = True) -> tuple:
    """(MODEL, CLIP or None) of a checkpoint by name in the checkpoints folder or by path, loaded by ComfyUI's own
    loader without its VAE (the command line's --checkpoint)."""
    import comfy.sd  # pulls in every model definition: only the command line needs it

    model, clip, _vae, _ = comfy.sd.load_checkpoint_guess_config(
        input_path("checkpoints", name), output_vae=False, output_clip=with_clip, output_clipvision=False,
        embedding_directory=folder_paths.get_folder_paths("embeddings"))
    return model, clip


def loras_folders() -> list[Path]:
    return [Path(p).resolve() for p in folder_paths.get_folder_paths("loras")]


def output_path(name: str) -> Path:
    """`name` (relative, e.g. "merged/my_stack" or "x.safetensors") inside the first loras folder; LycorisError for an
    empty name, an absolute one, or one that leaves the loras folders (`..`, a symlinked folder pointing out)."""
    name = name.strip().replace("\\", "/")
    if not name or name.endswith("/"):
        raise LycorisError("give the output a file name")
    if os.path.isabs(name) or Path(name).is_absolute() or re.match(r"[A-Za-z]:", name):  # C:/… is absolute on Windows
        raise LycorisError("the output name must be relative to the loras folder", file=name)
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    folder = loras_folders()[0]
    path = (folder / name).resolve()
    if not any(path.is_relative_to(root) for root in loras_folders()):
        raise LycorisError("the output must stay inside the loras folder", file=name)
    return path


# How far two readings of one process's start time may differ: psutil derives it from the boot time, which moves
# with the system clock on Linux; a reused pid belongs to a process started long after the first one.
START_TOLERANCE = 1.0  # seconds


@functools.cache
def process_started() -> float:
    """This process's start time (psutil), recorded by each tool write as its owner's. Read once, so this process's
    own records always match it exactly, whatever the clock does later."""
    return psutil.Process(os.getpid()).create_time()


def owner_alive(pid: int, started: float | None) -> bool:
    """writer.sweep's `owner_alive`: False only when the process is provably not running on this machine: no such
    pid (or a zombie), or a process of that pid started at another time than `started` (the pid was reused). True
    when it runs, or nothing can tell (no start time recorded, access denied). Never os.kill(pid, 0): on Windows that
    terminates the process."""
    if pid == os.getpid():
        return started is None or abs(process_started() - started) <= START_TOLERANCE
    try:
        process = psutil.Process(pid)
        if started is not None and abs(process.create_time() - started) > START_TOLERANCE:
            return False
        return process.status() != psutil.STATUS_ZOMBIE  # exited, not yet reaped by its parent: it runs no code
    except psutil.NoSuchProcess:  # includes psutil.ZombieProcess
        return False
    except (psutil.Error, OSError, ValueError, OverflowError):  # AccessDenied, a pid out of the OS's range, ...
        return True


def sweep_leftovers() -> None:
    """Remove what killed tool writes left in the loras folders (writer.sweep: only the writer's own workspace
    folders and lock files, and earlier versions' temporary files): at once those whose process ended on this
    machine (`owner_alive`), the others (another machine's, an earlier version's, a running process's) once an hour
    old. Called when the pack loads and before each write; never raises OSError, so it cannot break ComfyUI's
    start-up (a file that cannot be removed is logged as a warning)."""
    for folder in folder_paths.get_folder_paths("loras"):
        writer.sweep(folder, owner_alive=owner_alive)


def relative_name(path: Path) -> str:
    """The name the loader nodes list for a file written in a loras folder."""
    for root in loras_folders():
        if path.resolve().is_relative_to(root):
            return path.resolve().relative_to(root).as_posix()
    return path.name


def write_file(name: str, tensors: dict[str, torch.Tensor], metadata: dict, overwrite: bool) -> str:
    """Write the output into the loras folder, whole or not at all (writer.write); returns its name as listed there.
    Leftovers of killed writes are swept first; the write records this process as its owner. The loaders' list of
    files is refreshed, so the new file is offered without a restart."""
    path = output_path(name)
    sweep_leftovers()
    path = writer.write(path, tensors, metadata, overwrite, started=process_started())
    folder_paths.filename_list_cache.pop("loras", None)
    return relative_name(path)


def device() -> torch.device:
    """Where the tools' maths runs: the device ComfyUI runs models on."""
    return comfy.model_management.get_torch_device()


class Progress:
    """ComfyUI's progress bar for a node (shown on the node and in the queue), one step per module."""

    def __init__(self, total: int):
        self.bar = comfy.utils.ProgressBar(max(total, 1))

    def step(self) -> None:
        self.bar.update(1)


def output_name_input(default: str) -> io.String.Input:
    return io.String.Input("output_name", default=default,
                           tooltip="File name in the loras folder (subfolders allowed, '.safetensors' added).")


def overwrite_input() -> io.Boolean.Input:
    return io.Boolean.Input("overwrite", default=False, optional=True,
                            tooltip="Replace a file of the same name. Off: an existing file is never touched.")


def report_outputs() -> list:
    return [io.String.Output(display_name="file", tooltip="The written file's name in the loras folder."),
            io.String.Output(display_name="report", tooltip="What was written, the rank and error per module.")]


@dataclass
class ToolReport:
    """What a tool did: the file written, a line per module and what could not be carried over (never silently)."""

    tool: str
    file: str = ""
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    not_written: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        errors = [r.error for r in self.modules.values()]
        worst = f", largest relative error {max(errors):.2e}" if errors else ""
        skipped = f"; {len(self.not_written)} not written" if self.not_written else ""
        return (f"{self.tool}: {self.file or '(nothing written)'}: {len(self.modules)} modules{self.ranks()}{worst}"
                f"{skipped}")

    def ranks(self) -> str:
        """The ranks written (what a rank cap or rule gave, not the cap): ", rank 4", ", ranks 2–16", or ""."""
        ranks = sorted({r.rank for r in self.modules.values() if r.rank is not None})
        if not ranks:
            return ""
        return f", rank {ranks[0]}" if len(ranks) == 1 else f", ranks {ranks[0]}–{ranks[-1]}"

    def text(self) -> str:
        rows = [self.line(), *self.notes]
        listed = sorted(self.modules.items(), key=lambda kv: -kv[1].error)[:MAX_LISTED]
        rows += [f"  {key}: {r.form}{'' if r.rank is None else f', rank {r.rank}'}, error {r.error:.2e}"
                 for key, r in listed]
        if len(self.modules) > MAX_LISTED:
            rows.append(f"  ... and {len(self.modules) - MAX_LISTED} more modules (all in the file's metadata)")
        rows += [f"  not written: {key}: {reason}" for key, reason in self.not_written[:MAX_LISTED]]
        if len(self.not_written) > MAX_LISTED:
            rows.append(f"  ... and {len(self.not_written) - MAX_LISTED} more not written")
        return "\n".join(rows)

    def node_output(self) -> io.NodeOutput:
        return io.NodeOutput(self.file, self.text(), ui={"text": [self.text()]})
