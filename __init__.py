"""LyCORIS Nodes: LyCORIS adapter files applied exactly as the reference defines them, in ComfyUI."""

from comfy_api.latest import ComfyExtension, io

from .nodes.loaders import NODES

WEB_DIRECTORY = "./web"


class LycorisExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> LycorisExtension:
    return LycorisExtension()
