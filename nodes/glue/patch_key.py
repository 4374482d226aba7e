"""What a patch changes, as one value: ComfyUI's patch keys, read once.

ComfyUI names the target of a patch (its LoRA key maps' values, the keys of `ModelPatcher.add_patches`) as a weight
key, or a tuple (weight key, offset[, function]): the offset (dim, start, length) narrows the weight to a part of a
fused one (Flux's to_q: rows [0, h) of its qkv), and the function converts a change from the file's layout to
ComfyUI's before it is added (comfy/utils.py swap_scale_shift, keymap.RowPieces); ComfyUI reads them positionally
(comfy/model_patcher.py add_patches). `PatchKey.from_comfy` reads such a key where one reaches the pack, and
`as_comfy` gives ComfyUI back exactly the form its maps use: a str for a whole weight, (key, offset) for a part,
(key, offset or None, function) for a converted one.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

WEIGHT, BIAS = ".weight", ".bias"


@dataclass(frozen=True)
class Offset:
    """The part of a weight a patch changes: `length` entries from `start` along `dim` (dim 0: output rows)."""

    dim: int
    start: int
    length: int

    @classmethod
    def from_comfy(cls, offset: tuple[int, int, int] | None) -> "Offset | None":
        return None if offset is None else cls(*offset)

    def as_comfy(self) -> tuple[int, int, int]:
        return (self.dim, self.start, self.length)

    @property
    def end(self) -> int:
        return self.start + self.length

    def narrowed(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this part of a weight of `shape`."""
        return shape[:self.dim] + (self.length,) + shape[self.dim + 1:]


@dataclass(frozen=True)
class PatchKey:
    """A patch's target: the weight `weight` (a state-dict key), or its part `offset`, with ComfyUI's `convert`
    function from the file's layout to the model's where the model stores the parameter converted."""

    weight: str
    offset: Offset | None = None
    convert: Callable | None = None

    @classmethod
    def from_comfy(cls, key: "str | tuple") -> "PatchKey":
        """The value of a key ComfyUI (or a key map) gives: "key", (key, offset) or (key, offset, function)."""
        if isinstance(key, str):
            return cls(key)
        name, offset, *function = key
        return cls(name, Offset.from_comfy(offset), function[0] if function else None)

    def as_comfy(self) -> "str | tuple":
        """The key as ComfyUI's add_patches and key maps take it."""
        if self.convert is not None:
            return (self.weight, None if self.offset is None else self.offset.as_comfy(), self.convert)
        if self.offset is not None:
            return (self.weight, self.offset.as_comfy())
        return self.weight

    @property
    def is_whole(self) -> bool:
        """The whole parameter as the model stores it: no part of it, no conversion."""
        return self.offset is None and self.convert is None

    @property
    def is_converted(self) -> bool:
        return self.convert is not None

    @property
    def output_rows_only(self) -> bool:
        """The whole parameter or a slice of its output rows, unconverted: what maps onto a layer's output channels
        (a convert function needs the parameter itself)."""
        return self.convert is None and (self.offset is None or self.offset.dim == 0)

    def narrowed(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of what this key changes in a weight of `shape`."""
        return shape if self.offset is None else self.offset.narrowed(shape)

    def bias_twin(self) -> "PatchKey | None":
        """The same part of the layer's bias, for a weight key (diff_b / b_norm modules); None when the key is no
        weight or its part is not along the output rows (a bias has no other axis)."""
        if not self.weight.endswith(WEIGHT) or (self.offset is not None and self.offset.dim != 0):
            return None
        return replace(self, weight=self.weight[: -len(WEIGHT)] + BIAS)
