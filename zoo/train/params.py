"""Swapping a model's parameters in place (another dtype, another device) without untying them."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def swap_parameters(model: nn.Module, new: Callable[[nn.Parameter], nn.Parameter | None]) -> None:
    """Replace every parameter p of `model` for which `new(p)` returns one, in each module that holds p: a tied
    weight (an embedding shared with the output head) stays one parameter, swapped once."""
    swapped: dict[int, tuple[nn.Parameter, nn.Parameter | None]] = {}  # the old one kept: its id stays its own
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in swapped:
                swapped[id(p)] = (p, new(p))
            replacement = swapped[id(p)][1]
            if replacement is not None:
                setattr(module, name, replacement)
