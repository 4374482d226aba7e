"""LyCORIS Nodes' tools on the command line: the same Save, Resize, Extract and Convert as the nodes.

    python custom_nodes/lycoris-nodes/lycoris_tools.py resize my_lora.safetensors --rank 16 -o my_lora_r16
    python lycoris_tools.py --help                  (each command: python lycoris_tools.py resize --help)

Run it with the Python that runs ComfyUI. ComfyUI is found as the folder this pack sits in (custom_nodes/..), or
$COMFYUI_PATH, or --comfyui. Files are read from the loras folder (or any path given), outputs are written only into
the loras folder, as the nodes do; --base-directory / --extra-model-paths-config select folders as ComfyUI's own
options do.
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

PACK_DIR = Path(__file__).resolve().parent
PACK_NAME = "lycoris_nodes"


def find_comfyui(given: str | None) -> Path:
    candidates = [given, os.environ.get("COMFYUI_PATH"), PACK_DIR.parent.parent, PACK_DIR / ".deps" / "ComfyUI"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "main.py").is_file() and (Path(candidate) / "comfy").is_dir():
            return Path(candidate).resolve()
    sys.exit("no ComfyUI found: run this from custom_nodes/<pack>/ inside ComfyUI, or give --comfyui / COMFYUI_PATH")


def start_comfyui(comfy_dir: Path, options: argparse.Namespace) -> None:
    """ComfyUI as a library: its folder first on sys.path, its options set before folder_paths reads them."""
    sys.path.insert(0, str(comfy_dir))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = options.cpu
    args.base_directory = options.base_directory
    import folder_paths  # noqa: F401  (reads args.base_directory when first imported)
    import utils.extra_config

    default_config = comfy_dir / "extra_model_paths.yaml"
    for config in ([str(default_config)] if default_config.is_file() else []) + (options.extra_model_paths_config or []):
        utils.extra_config.load_extra_path_config(config)


def import_pack():
    spec = importlib.util.spec_from_file_location(PACK_NAME, PACK_DIR / "__init__.py",
                                                  submodule_search_locations=[str(PACK_DIR)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = pack
    spec.loader.exec_module(pack)
    return pack


def bootstrap_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # `--base` is not `--base-directory`
    parser.add_argument("--comfyui", help="the ComfyUI folder (default: the one this pack is installed in)")
    parser.add_argument("--base-directory", help="ComfyUI's --base-directory (models, input, output folders)")
    parser.add_argument("--extra-model-paths-config", action="append", help="ComfyUI's extra_model_paths.yaml")
    parser.add_argument("--cpu", action="store_true", help="run the maths on the CPU even when a GPU is present")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, _rest = bootstrap_parser().parse_known_args(argv)
    start_comfyui(find_comfyui(options.comfyui), options)
    import_pack()
    cli = importlib.import_module(f"{PACK_NAME}.nodes.tools.cli")
    return cli.main(argv, bootstrap_parser())


if __name__ == "__main__":
    sys.exit(main())
