"""The command-line side of the tools (lycoris_tools.py starts ComfyUI as a library, then calls `main`).

Each tool module gives `add_arguments(parser)` and `run_cli(args) -> ToolReport`; the report is printed, and a
LycorisError ends the run with its message and exit code 2 (nothing half-written: see writer.py).
"""

import argparse
import importlib
import sys

from ...lycoris_core import LycorisError

# command -> module in this package; each module documents its own options
COMMANDS = {
    "save": ".save",
    "resize": ".resize",
    "extract": ".extract",
    "convert": ".convert",
}


def parser(parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lycoris_tools.py", parents=[parent], allow_abbrev=False,
                                  description="LyCORIS Nodes' tools: save a weighted stack, resize, extract, convert.")
    commands = top.add_subparsers(dest="command", required=True)
    for command, module_name in COMMANDS.items():
        module = importlib.import_module(module_name, __package__)
        sub = commands.add_parser(command, help=module.CLI_HELP, description=module.CLI_HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run_cli)
    return top


def main(argv: list[str], parent: argparse.ArgumentParser) -> int:
    args = parser(parent).parse_args(argv)
    try:
        report = args.run(args)
    except LycorisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    return 0
