"""LyCORIS Nodes: LyCORIS adapter files applied exactly as the reference defines them, in ComfyUI."""

import sys

from comfy_api.latest import ComfyExtension, io

from .nodes.glue import everywhere, routes
from .nodes.inspection import block_info, info
from .nodes.loading import loaders, row_loader, weighting
from .nodes.scheduling import schedule, stack
from .nodes.tools import convert, extract, resize, save
from .nodes.tools.common import sweep_leftovers

WEB_DIRECTORY = "./web"

# What tool writes killed mid-way (kill -9, a crash, a power cut) left in the loras folders goes at start-up; files
# that cannot be removed are logged, never raised into ComfyUI's start-up.
sweep_leftovers()

# ComfyUI's LoRA loading functions, wrapped: they do what they did until the "exact everywhere" switch is turned on
# (nodes/glue/everywhere.py).
everywhere.install()

# ComfyUI's server is running before custom nodes load. Imported as a library (tests, scripts) there is none, and
# importing server.py just to find that out would pull in the whole frontend stack.
_server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
if _server is not None:
    routes.register(_server.routes)
    _server.add_on_prompt_handler(everywhere.on_prompt)  # the exact-everywhere setting is read again at each queue


class LycorisExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [*loaders.NODES, *row_loader.NODES, info.LycorisInfo, *weighting.NODES, block_info.LycorisBlockInfo, *stack.NODES, *schedule.NODES,
                *save.NODES, *resize.NODES, *extract.NODES, *convert.NODES]


async def comfy_entrypoint() -> LycorisExtension:
    return LycorisExtension()
