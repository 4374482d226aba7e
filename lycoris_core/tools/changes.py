"""A module's applied change, as the tools read it: factored when the algorithm knows its change as A @ B (no W' is
formed), else dense, computed by the same patch code the loader uses (patch.change), so the tools reproduce exactly
what loading the file does."""

import torch

from ..algos import BY_NAME, lokr
from ..bypass import reads_weight
from ..casting import cast_all
from ..module import Plan
from ..patch import change
from .lowrank import Factors


def is_factored(plan: Plan) -> bool:
    """A change that is m·A@B: an additive algorithm that declares its factors, without DoRA (whose change is not
    linear in the factors). A LoKr on a window of a fused weight's rows (row_offset) is not: its factors span the
    whole fused height, which only the target knows."""
    return (BY_NAME[plan.algorithm].factored is not None and plan.dora_axis is None
            and not isinstance(plan.layout, lokr.RowWindowLayout))


def factored_change(plan: Plan, tensors: dict[str, torch.Tensor], strength: float, weight: torch.Tensor | None,
                    device: torch.device) -> Factors:
    """m·ΔW₂ as Factors (fp32 on `device`); `weight` (the weight before this module) is read only by algorithms whose
    change reads it."""
    algorithm = BY_NAME[plan.algorithm]
    t = cast_all(tensors, device, torch.float32, keep=algorithm.dense)
    w = None if weight is None else weight.to(device=device, dtype=torch.float32)
    up, down = algorithm.factored(t, plan.layout, w)
    return Factors(up * strength, down)


def dense_change(plan: Plan, tensors: dict[str, torch.Tensor], strength: float, weight: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """W'(m) − W in fp32 on `device`, in W's shape."""
    w = weight.to(device=device, dtype=torch.float32)
    t = cast_all(tensors, device, torch.float32, keep=BY_NAME[plan.algorithm].dense)
    return change(plan, t, w, strength)


def module_change(plan: Plan, tensors: dict[str, torch.Tensor], strength: float, weight: torch.Tensor | None,
                  device: torch.device) -> "Factors | torch.Tensor":
    """Factored when it can be, dense otherwise (then `weight` is required: its shape at least, its values when the
    change reads them)."""
    if weight is None and reads_weight(plan):
        raise ValueError(f"{plan.label}: the change of this module reads the base weight, which was not given")
    if is_factored(plan):
        return factored_change(plan, tensors, strength, weight, device)
    if weight is None:
        raise ValueError(f"{plan.label}: the change of this module needs the base weight's shape")
    return dense_change(plan, tensors, strength, weight, device)
