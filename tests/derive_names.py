"""scripts/derive_diffusers_names.py as a module for the tests (scripts/ is no package)."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "derive_diffusers_names.py"
_spec = importlib.util.spec_from_file_location("derive_diffusers_names", _PATH)
derive = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = derive  # its dataclasses look their module up
_spec.loader.exec_module(derive)
