"""`make gpu-kit`: the GPU evidence kit as one folder, dist/gpu-kit/, to carry to an NVIDIA machine without internet.

    dist/gpu-kit/
        run.sh                 the one command (see gpu_kit/run.sh)
        ComfyUI-0.33.*.tar.gz  ComfyUI 0.33.0, the source tarball from ../shared/comfyui, unchanged
        wheels.tar.xz          the wheels in gpu_kit/wheels.lock (CPython 3.12, manylinux x86_64), stored
                               uncompressed inside one xz archive (preset 3): ~30% smaller than the wheels themselves
        requirements.txt       the lock's pins, for `pip install --no-index`
        pack/                  this pack's runtime files (git ls-files), as ComfyUI would load them
        checks/                the kit's checks (gpu_kit/) and the reference file factory of the tests
        manifest.json          versions, sizes, sha256 of everything above, the commit it was built from

`--lock` refreshes gpu_kit/wheels.lock from gpu_kit/requirements.in with pip's resolver for the target (slow: it
reads torch's metadata); the build itself only downloads the lock, checks that every requirement of every wheel is
met by the folder or by the image (torch and what comes with it), and packs.
"""

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

KIT_SRC = Path(__file__).resolve().parent
REPO = KIT_SRC.parent
LOCK = KIT_SRC / "wheels.lock"
SIZE_LIMIT = 60 * 10**6  # bytes: the whole folder
# xz preset 3, not the default 6: 42 s against 78 s on two cores for 5 MB more (45.8 against 40.6 MB of wheels, the
# kit 54 MB of its 60; measured 2026-11-29). The kit is built in every CI run (tests/test_gpu_kit.py).
XZ_PRESET = 3

# The target machine: CPython 3.12 on manylinux x86_64 with a CUDA PyTorch preinstalled.
TARGET_PYTHON = "3.12"
PLATFORM_FLAGS = ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp",
                  "--abi", "cp312", "--abi", "abi3", "--abi", "none",
                  *[arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                    "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64")
                    for arg in ("--platform", tag)]]
# Wheels taken pure-Python although a compiled one exists: comfy-kitchen's CUDA build is 58 MB (ComfyUI then uses its
# eager torch backend for quantized layouts, which the kit's fp8 checks go through either way).
PURE = {"comfy-kitchen"}
# What the image brings: torch with the CUDA build it was made for, and the packages that must match it. Everything
# these need is theirs too (computed from the resolver's report when locking).
IMAGE_ROOTS = ("torch", "torchvision", "torchaudio")
TARGET_MARKERS = {**default_environment(), "python_version": TARGET_PYTHON, "python_full_version": f"{TARGET_PYTHON}.0",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}
PACK_PATHS = ("__init__.py", "lycoris_core", "nodes", "presets", "web", "pyproject.toml", "requirements.txt",
              "LICENSE", "README.md")
CHECK_FILES = {"gpu_kit": KIT_SRC, "reference": REPO / "tests" / "reference"}


def log(message: str) -> None:
    print(f"gpu-kit: {message}", flush=True)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


# ---- the lock ------------------------------------------------------------------------------------------------------

def _image_closure(install: list[dict]) -> set[str]:
    """Names reachable from IMAGE_ROOTS through the resolved Requires-Dist: the image has them already."""
    requires = {canonicalize_name(item["metadata"]["name"]): item["metadata"].get("requires_dist") or []
                for item in install}
    seen, todo = set(), [canonicalize_name(n) for n in IMAGE_ROOTS]
    while todo:
        name = todo.pop()
        if name in seen or name not in requires:
            continue
        seen.add(name)
        for text in requires[name]:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**TARGET_MARKERS, "extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def write_lock() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *PLATFORM_FLAGS,
            "--target", str(Path(tmp) / "target"), "-r", str(KIT_SRC / "requirements.in"))
        install = json.loads(report.read_text(encoding="utf-8"))["install"]
    image = _image_closure(install)
    pins = sorted(f"{item['metadata']['name']}=={item['metadata']['version']}" for item in install
                  if canonicalize_name(item["metadata"]["name"]) not in image)
    header = ("# Generated by `python gpu_kit/build.py --lock` from gpu_kit/requirements.in for CPython "
              f"{TARGET_PYTHON}, manylinux x86_64.\n# Left to the image (torch and what it brings): "
              f"{', '.join(sorted(image))}\n")
    LOCK.write_text(header + "\n".join(pins) + "\n", encoding="utf-8")
    log(f"{LOCK.relative_to(REPO)}: {len(pins)} pins, {len(image)} left to the image")


def lock_pins() -> list[str]:
    return [line for line in LOCK.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


def image_names() -> set[str]:
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        if line.startswith("# Left to the image"):
            return {canonicalize_name(n.strip()) for n in line.split(":", 1)[1].split(",")}
    raise RuntimeError(f"{LOCK} does not say what it leaves to the image")


# ---- the wheels ----------------------------------------------------------------------------------------------------

def download(dest: Path) -> list[Path]:
    pins = lock_pins()
    compiled = [p for p in pins if canonicalize_name(Requirement(p).name) not in PURE]
    pure = [p for p in pins if canonicalize_name(Requirement(p).name) in PURE]
    pip("download", "--quiet", "--no-deps", "--dest", str(dest), *PLATFORM_FLAGS, *compiled)
    if pure:
        pip("download", "--quiet", "--no-deps", "--dest", str(dest), "--only-binary=:all:", "--platform", "any",
            "--python-version", TARGET_PYTHON, "--implementation", "py", "--abi", "none", *pure)
    wheels = sorted(dest.glob("*.whl"))
    names = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    missing = [p for p in pins if canonicalize_name(Requirement(p).name) not in names]
    if missing:
        raise RuntimeError(f"pip downloaded no wheel for {missing}")
    return wheels


def wheel_metadata(wheel: Path) -> tuple[str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode("utf-8"))
    return canonicalize_name(meta["Name"]), meta.get_all("Requires-Dist") or []


def unmet_requirements(wheels: list[Path], image: set[str]) -> list[str]:
    """Every Requires-Dist (its markers evaluated for the target) that no wheel here and nothing in the image meets:
    pip would stop on it on the offline machine."""
    metadata = dict(wheel_metadata(w) for w in wheels)
    versions = {canonicalize_name(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    unmet = []
    for owner, requires in metadata.items():
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**TARGET_MARKERS, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            if name in image:
                continue
            if name not in versions or not req.specifier.contains(versions[name], prereleases=True):
                unmet.append(f"{owner} needs {text}")
    return unmet


def pack_wheels(wheels: list[Path], out: Path) -> None:
    """One tar.xz of the wheels rewritten as stored (uncompressed) zips: xz then sees the raw files. A wheel's
    RECORD hashes its files, not the archive, so pip installs the rewritten wheel as the original."""
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "wheels.tar"
        with tarfile.open(tar_path, "w") as tar:
            for wheel in wheels:
                raw = io.BytesIO()
                with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as dst:
                    for info in src.infolist():
                        data = src.read(info)  # before compress_type changes: the same ZipInfo object
                        info.compress_type = zipfile.ZIP_STORED
                        dst.writestr(info, data)
                entry = tarfile.TarInfo(f"wheels/{wheel.name}")
                entry.size = raw.tell()
                raw.seek(0)
                tar.addfile(entry, raw)
        xz = shutil.which("xz")
        if xz:  # multi-threaded: a third of the time of Python's lzma on two cores
            with open(out, "wb") as f:
                subprocess.run([xz, f"-{XZ_PRESET}", "-T0", "-c", str(tar_path)], stdout=f, check=True)
        else:
            import lzma

            with open(tar_path, "rb") as src, lzma.open(out, "wb", preset=XZ_PRESET) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)


# ---- the folder ----------------------------------------------------------------------------------------------------

def comfyui_tarball() -> Path:
    found = sorted((REPO.parent / "shared" / "comfyui").glob("ComfyUI-0.33.*.tar.gz"))
    if not found:
        raise FileNotFoundError("no ../shared/comfyui/ComfyUI-0.33.*.tar.gz beside this repository")
    return found[-1]


def tracked(paths) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=REPO, capture_output=True, check=True)
    return [REPO / p for p in out.stdout.decode("utf-8").split("\0") if p]


def copy_tracked(paths, base: Path, dest: Path) -> None:
    for path in tracked(paths):
        target = dest / path.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tarball = comfyui_tarball()
    shutil.copy2(tarball, out / tarball.name)
    copy_tracked(PACK_PATHS, REPO, out / "pack")
    for name, source in CHECK_FILES.items():
        copy_tracked([str(source.relative_to(REPO))], source, out / "checks" / name)
    shutil.copy2(KIT_SRC / "run.sh", out / "run.sh")
    (out / "run.sh").chmod(0o755)
    (out / "requirements.txt").write_text("\n".join(lock_pins()) + "\n", encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(Path(tmp))
        unmet = unmet_requirements(wheels, image_names())
        if unmet:
            raise RuntimeError("the wheels would not install offline:\n  " + "\n  ".join(unmet))
        pack_wheels(wheels, out / "wheels.tar.xz")
        wheel_list = [{"file": w.name, "bytes": w.stat().st_size} for w in wheels]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    manifest = {
        "commit": commit,
        "target": f"CPython {TARGET_PYTHON}, manylinux x86_64, a CUDA PyTorch installed",
        "left_to_the_image": sorted(image_names()),
        "comfyui": {"file": tarball.name, "sha256": sha256(out / tarball.name)},
        "wheels": wheel_list,
        "wheels_archive": {"file": "wheels.tar.xz", "bytes": (out / "wheels.tar.xz").stat().st_size,
                           "sha256": sha256(out / "wheels.tar.xz")},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    size = folder_size(out)
    manifest["bytes"] = size
    log(f"{out}: {size / 1e6:.1f} MB ({len(wheel_list)} wheels, {sum(w['bytes'] for w in wheel_list) / 1e6:.1f} MB "
        f"as downloaded, {manifest['wheels_archive']['bytes'] / 1e6:.1f} MB packed)")
    if size >= SIZE_LIMIT:
        raise RuntimeError(f"the kit is {size / 1e6:.1f} MB, over the {SIZE_LIMIT / 1e6:.0f} MB limit")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "dist" / "gpu-kit")
    parser.add_argument("--lock", action="store_true", help="refresh gpu_kit/wheels.lock instead of building")
    opts = parser.parse_args(argv)
    if opts.lock:
        write_lock()
    else:
        build(opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
