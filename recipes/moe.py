"""What training a Mixture-of-Experts model adds to a recipe: the balancing terms of its loss and the expert load it
logs.

`Balance.for_model` reads the model section's --aux-loss-coef (auto: the checkpoint's router_aux_loss_coef),
--aux-loss (batch or per-document) and --router-z-loss; a dense model with any of them set is refused in one line.
Each pack's loss share comes from `Balance.loss` (zoo's Decoder.loss with the terms and its `parts`), summed over the
step's packs and, at the step's end (`end_step`), over every process: `aux_loss` and `z_loss` (the target-weighted
mean over the step's packs, without their coefficients), `expert_load_max` / `expert_load_min` (the most and least
loaded expert's share of the top-k choices times the number of experts, over every MoE layer: 1.0 is perfectly
even) go to metrics.jsonl and OUT/aux_loss.png.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zoo.core.moe import moe_layers
from zoo.core.packing import Packed
from zoo.errors import ZooError


def parse_coef(value: str) -> float | None:
    """--aux-loss-coef: "auto" (None) or a finite number at least 0."""
    if value == "auto":
        return None
    try:
        coef = float(value)
    except ValueError:
        coef = float("nan")
    if not 0 <= coef < float("inf"):
        raise ZooError(f"--aux-loss-coef must be auto or a finite number at least 0, got {value!r}")
    return coef


def check_coef(value: str) -> str | None:
    """recipes.config's check of --aux-loss-coef: what was wanted, or None."""
    try:
        parse_coef(str(value))
    except ZooError:
        return "auto or a finite number at least 0"
    return None


@dataclass
class Balance:
    """A recipe's MoE balancing: the loss terms of each pack, and the step's sums of their parts."""

    aux_loss_coef: float
    aux_loss: str
    z_loss_coef: float
    sums: dict[str, Tensor] = field(default_factory=dict)

    @staticmethod
    def for_model(model: nn.Module, aux_loss_coef: str, aux_loss: str, z_loss_coef: float) -> Balance | None:
        """The balancing the model section's options ask for; None for a dense model (which refuses any)."""
        coef = parse_coef(aux_loss_coef)
        # a text model's MoE layers (a LLaVA's language model trains without balancing terms: its loss has none)
        if not (moe_layers(model) and getattr(model, "decoder", None) is model):
            asked = [f for f, v in (("--aux-loss-coef", coef), ("--router-z-loss", z_loss_coef)) if v]
            if asked or aux_loss != "batch":
                raise ZooError(f"{', '.join(asked) or '--aux-loss'} balances the experts of a Mixture-of-Experts "
                               "text model; this model has no MoE layers its loss balances")
            return None
        if coef is None:
            config: Any = getattr(model, "config", None)
            coef = float(getattr(config, "router_aux_loss_coef", 0.0))
        return Balance(coef, aux_loss, z_loss_coef)

    def loss(self, model: Any, packed: Packed, denominator: int) -> Tensor:
        """One pack's loss share with the balancing terms (zoo's Decoder.loss), its parts summed into the step's."""
        parts: dict[str, Tensor] = {}
        loss: Tensor = model.loss(packed, denominator=denominator, aux_loss_coef=self.aux_loss_coef,
                                  aux_loss=self.aux_loss, z_loss_coef=self.z_loss_coef, parts=parts)
        for key in ("aux_loss", "z_loss", "expert_counts"):
            self.sums[key] = self.sums[key] + parts[key] if key in self.sums else parts[key].clone()
        return loss

    def end_step(self) -> dict[str, float]:
        """The step's metrics (every process calls this: the sums are all-reduced); the sums start over."""
        if not self.sums:
            return {}
        aux, z, counts = self.sums["aux_loss"].float(), self.sums["z_loss"].float(), self.sums["expert_counts"]
        if dist.is_initialized():
            stacked = torch.cat([aux.reshape(1), z.reshape(1), counts.reshape(-1)])
            dist.all_reduce(stacked)
            aux, z, counts = stacked[0], stacked[1], stacked[2:].view_as(counts)
        # sequence-parallel shards and data-parallel packs hold distinct tokens: the summed counts are the step's;
        # each pack's terms were weighted by its share of the step's targets: their sum is the step's mean
        share_LE = counts / counts.sum(dim=1, keepdim=True).clamp(min=1) * counts.shape[1]
        self.sums = {}
        return {"aux_loss": aux.item(), "z_loss": z.item(), "expert_load_max": share_LE.max().item(),
                "expert_load_min": share_LE.min().item()}
