"""What training a Mixture-of-Experts model adds to a recipe: the balancing terms of its loss, the expert load it
logs, and aux-loss-free balancing (a per-expert bias on the router's choice, moved after every step toward an even
load, as DeepSeek-V3 and torchtitan do).

`Balance.for_model` reads the model section's --aux-loss-coef (auto: the checkpoint's router_aux_loss_coef),
--aux-loss (batch or per-document), --router-z-loss and --router-bias-update-rate; a dense model with any of them set
is refused in one line. With a bias rate, every MoE layer gets a `router_bias` buffer (the model's config says
router_bias, so OUT/model and checkpoints keep it, and a resume restores it exactly); after each step it moves by the
rate times the sign of each expert's distance below the mean load (sign(1 - share x E)). A family whose checkpoints
hold that bias (DeepSeek-V3's and GLM-4.5's `e_score_correction_bias`) moves its own; transformers' classes of the
others have no place for it: there --export-hf is refused up front.
Each pack's loss share comes from `Balance.loss` (zoo's Decoder.loss with the terms and its `parts`), summed over the
step's packs and, at the step's end (`end_step`), over every process: `aux_loss` and `z_loss` (the target-weighted
mean over the step's packs, without their coefficients), `expert_load_max` / `expert_load_min` (the most and least
loaded expert's share of the top-k choices times the number of experts, over every MoE layer: 1.0 is perfectly
even) go to metrics.jsonl and OUT/aux_loss.png.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zoo.core.contract import ZooModel, is_zoo_model
from zoo.core.moe import MoE, balancing_terms, moe_layers
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models import FAMILIES

# steps in a row without a token after which an expert counts as dropped by its router (a collapse: the router
# sends everything to the others, and the expert, getting no gradient, never comes back by itself)
COLLAPSED_AFTER = 20


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
    """recipes.engine.config's check of --aux-loss-coef: what was wanted, or None."""
    try:
        parse_coef(str(value))
    except ZooError:
        return "auto or a finite number at least 0"
    return None


def _hf_holds_router_bias(family: str, config: Any) -> bool:
    """Whether transformers' class of `family` holds per-expert router biases: its export of this config with them
    is not refused."""
    fields = {f.name for f in dataclasses.fields(config)}
    try:
        FAMILIES[family].config_to_hf(dataclasses.replace(config, router_bias=True) if "router_bias" in fields
                                      else config)
    except ZooError:
        return False
    return True


@dataclass
class Balance:
    """A recipe's MoE balancing: the loss terms of each pack, and the step's sums of their parts."""

    aux_loss_coef: float
    aux_loss: str
    z_loss_coef: float
    bias_rate: float = 0.0
    layers: list[MoE] = field(default_factory=list)
    sums: dict[str, Tensor] = field(default_factory=dict)
    idle_LE: Tensor | None = None  # for each layer's experts: the steps in a row it has received no token

    @staticmethod
    def for_model(model: nn.Module, aux_loss_coef: str, aux_loss: str, z_loss_coef: float, bias_rate: float = 0.0,
                  export_hf: bool = False) -> Balance | None:
        """The balancing the model section's options ask for; None for a dense model (which refuses any)."""
        coef = parse_coef(aux_loss_coef)
        # the language model's MoE layers (a vision-language model's too: its loss adds their terms)
        layers = moe_layers(cast(nn.Module, cast(ZooModel, model).decoder)) if is_zoo_model(model) else []
        if not layers:
            asked = [f for f, v in (("--aux-loss-coef", coef), ("--router-z-loss", z_loss_coef),
                                    ("--router-bias-update-rate", bias_rate)) if v]
            if asked or aux_loss != "batch":
                raise ZooError(f"{', '.join(asked) or '--aux-loss'} balances the experts of a Mixture-of-Experts "
                               "text model; this model has no MoE layers its loss balances")
            return None
        # the language model's config holds the coefficient (a vision-language model's decoder is its language model)
        config: Any = getattr(cast(ZooModel, model).decoder, "config", None)
        if bias_rate and cast(object, cast(ZooModel, model).decoder) is not model:  # a vision-language model
            raise ZooError("--router-bias-update-rate trains per-expert router biases of a text model; balance a "
                           "vision-language model's experts with --aux-loss-coef")
        if coef is None:  # the checkpoint's, held to what the flag itself must be (-1 or NaN trained silently)
            raw = getattr(config, "router_aux_loss_coef", 0.0)
            coef = float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else float("nan")
            if not 0 <= coef < float("inf"):
                raise ZooError("--aux-loss-coef auto: expected the checkpoint's router_aux_loss_coef (config.json) "
                               f"to be a finite number at least 0, got {raw!r}; pass --aux-loss-coef")
        if bias_rate:
            if export_hf and not _hf_holds_router_bias(cast(ZooModel, model).family, config):
                raise ZooError("--router-bias-update-rate trains per-expert router biases, which transformers' class "
                               f"of {model.family} cannot hold: drop --export-hf (OUT/model keeps them), or balance "
                               "with --aux-loss-coef")
            for layer in layers:
                if layer.router_bias is None:
                    layer.add_router_bias()
            if any(f.name == "router_bias" for f in dataclasses.fields(config)):  # else its layers always have one
                model.config = dataclasses.replace(config, router_bias=True)
        return Balance(coef, aux_loss, z_loss_coef, bias_rate, layers)

    def loss(self, model: ZooModel, packed: Packed, denominator: int) -> Tensor:
        """One pack's loss share with the balancing terms (the contract's LanguageModel.loss, or a vision-language
        model's, which takes the same arguments), its parts summed into the step's."""
        parts: dict[str, Tensor] = {}
        loss = cast(Any, model).loss(packed, denominator=denominator, aux_loss_coef=self.aux_loss_coef,
                                     aux_loss=self.aux_loss, z_loss_coef=self.z_loss_coef, parts=parts)
        self._add(parts)
        return loss

    def terms(self, packed: Packed, logits: list[Tensor], share: float) -> Tensor:
        """The balancing terms of a forward whose router logits a recipe recorded itself (recipes.dpo: the policy's
        pass that scores the pairs), weighted by `share` (the pack's part of the step), their parts summed into the
        step's."""
        parts: dict[str, Tensor] = {}
        total = balancing_terms(self.layers, logits, packed, share, self.aux_loss_coef, self.aux_loss,
                                self.z_loss_coef, parts)
        self._add(parts)
        return total

    def _add(self, parts: dict[str, Tensor]) -> None:
        for key in ("aux_loss", "z_loss", "expert_counts"):
            self.sums[key] = self.sums[key] + parts[key] if key in self.sums else parts[key].clone()

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
        idle = (counts == 0).long()
        self.idle_LE = idle if self.idle_LE is None else (self.idle_LE + 1) * idle
        if self.bias_rate:  # every process moves its copy alike: the counts are the step's, all-reduced
            with torch.no_grad():
                for layer, share_E in zip(self.layers, share_LE):
                    assert layer.router_bias is not None
                    layer.router_bias += self.bias_rate * torch.sign(1.0 - share_E).to(layer.router_bias.device)
        self.sums = {}
        return {"aux_loss": aux.item(), "z_loss": z.item(), "expert_load_max": share_LE.max().item(),
                "expert_load_min": share_LE.min().item(),
                "experts_idle": int((self.idle_LE >= COLLAPSED_AFTER).sum().item())}
