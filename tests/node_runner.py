"""Run a node the way ComfyUI's executor does, on either ComfyUI of the test matrix (import after conftest ran).

`execution._async_map_node_over_list` validates the V3 class, clones it with its hidden inputs and calls it. Its
hidden-input argument changed: 0.3.75 takes `hidden_inputs={...}`, 0.33 takes `v3_data={"hidden_inputs": {...}}`.
"""

import asyncio
import contextlib
import inspect

import execution
import torch
from comfy_api.latest import io

_TAKES_V3_DATA = "v3_data" in inspect.signature(execution._async_map_node_over_list).parameters


def _check_combos(cls, inputs: dict) -> None:
    info = cls.INPUT_TYPES()
    specs = {**info["required"], **info.get("optional", {})}
    for name, value in inputs.items():
        spec = specs[name]
        if len(spec) > 1 and isinstance(spec[1], dict) and "options" in spec[1]:
            assert value in spec[1]["options"], f"{name}={value!r} is not offered"


def map_node(cls, inputs: dict, uid: str | None = None, inference: bool = False) -> list:
    """The executor's raw results for one call of `cls` with `inputs`, as node `uid` (its hidden UNIQUE_ID)."""
    _check_combos(cls, inputs)
    hidden = {} if uid is None else {io.Hidden.unique_id: uid}
    extra = {"v3_data": {"hidden_inputs": hidden}} if _TAKES_V3_DATA else {"hidden_inputs": hidden}
    with torch.inference_mode() if inference else contextlib.nullcontext():
        return asyncio.run(execution._async_map_node_over_list(
            "test-prompt", uid or "1", cls, {k: [v] for k, v in inputs.items()}, cls.FUNCTION, **extra))


def execute(cls, uid: str | None = None, inference: bool = False, **inputs):
    """The NodeOutput (.result, .ui) of one call of `cls`."""
    (output,) = map_node(cls, inputs, uid, inference)
    return output
