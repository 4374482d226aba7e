"""Import this repo the way ComfyUI does: as a package loaded from its folder's __init__.py.

The pack uses relative imports (`nodes` would otherwise collide with ComfyUI's own `nodes.py`), so node-level code
is reached as `lycoris_nodes.nodes.*` after `import_pack()`.
"""

import importlib.util
import sys
from pathlib import Path

from comfy_env import REPO_ROOT, setup_comfy

PACK_NAME = "lycoris_nodes"


def import_pack():
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    setup_comfy()
    spec = importlib.util.spec_from_file_location(PACK_NAME, Path(REPO_ROOT) / "__init__.py",
                                                  submodule_search_locations=[str(REPO_ROOT)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = pack
    spec.loader.exec_module(pack)
    return pack
