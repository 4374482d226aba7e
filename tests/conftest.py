"""Shared test setup: a real ComfyUI on the CPU, importable before any test module imports `comfy.*`."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from comfy_env import setup_comfy

setup_comfy()  # sys.path + args.cpu = True, before anything imports comfy.model_management

import pytest
from pack import import_pack

import_pack()  # so test modules can `from lycoris_nodes... import` at module level


@pytest.fixture(scope="session")
def pack():
    """The pack imported the way ComfyUI imports it (package `lycoris_nodes`)."""
    return import_pack()
