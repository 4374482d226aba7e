"""Hard-link this venv's torch build (torch, torchvision, triton and the CUDA libraries they pin) into a new venv.

    <this venv's python> scripts/seed_torch.py <new venv's python> torch==X torchvision==Y

Run by scripts/setup.sh when it creates a venv beside one that has the same pins: pip then finds them installed and
skips ~5 GB of unzipping (0.33's pip step took 157 s in CI with it, ~200 s before). Every file a distribution's
RECORD lists inside site-packages is linked, the dist-info included; its console scripts (paths outside
site-packages) are not (torch's are not used). Exits 1, linking nothing, when this venv's versions are not the pins.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# torch and torchvision (pinned) and what torch pins exactly with them on Linux: the large part of the venv
TORCH_FAMILY = re.compile(r"(torch|torchvision|triton|nvidia-.+|cuda-.+)", re.IGNORECASE)


def pins_installed(pins: list[str]) -> bool:
    for pin in pins:
        name, version = pin.split("==")
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            return False
        if installed.split("+")[0] != version:
            return False
    return True


def site_packages(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed: a copy does the same job, slower
        shutil.copy2(source, target)


def main(new_python: str, pins: list[str]) -> int:
    if not pins_installed(pins):
        return 1
    ours = Path(metadata.distribution("torch").locate_file(""))
    theirs = site_packages(new_python)
    files = size = 0
    for dist in metadata.distributions():
        if not TORCH_FAMILY.fullmatch(dist.metadata["Name"] or ""):
            continue
        for entry in dist.files or []:
            if entry.parts[0] == ".." or not (ours / entry).is_file():
                continue
            target = theirs / entry
            if not target.exists():
                link(ours / entry, target)
                files += 1
                size += target.stat().st_size
    print(f"setup: {' '.join(pins)} and their CUDA libraries linked from {ours.parents[2].name} "
          f"({files} files, {size / 1e9:.1f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
