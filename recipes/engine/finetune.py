"""The second half every fine-tuning recipe (sft, llava, vlm) runs once its model is built and its parts chosen:
sequence parallelism, the weights (onto a model built on meta), the loop, the export and the closing line. A recipe
keeps what is its own (its data, which parameters train, its adapters) and hands the rest here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from recipes.data import PackedData
from recipes.engine.build import Wrap, load_sharded, parallelize_model
from recipes.engine.export import export
from recipes.engine.loop import train
from recipes.engine.metrics import summary
from recipes.engine.processes import Dist
from recipes.engine.sections import LoRASection, RecipeConfig
from zoo.io.tokenizer import Tokenizer
from zoo.models import Model

D = TypeVar("D", bound=PackedData)


class FineTuneConfig(RecipeConfig, Protocol):
    """A fine-tuning recipe's config: the shared sections and its LoRA's."""

    @property
    def lora(self) -> LoRASection: ...


def eval_data_of(cfg: RecipeConfig, d: Dist, read: Callable[[str], D]) -> D | None:
    """The --eval-data set `read` reads (its description printed), None without one."""
    if not cfg.data.eval_data:
        return None
    data = read(cfg.data.eval_data)
    if d.main:
        print(f"eval data: {data.describe()}")
    return data


def train_and_export(cfg: FineTuneConfig, d: Dist, model: Model, on_meta: bool, wrap: Wrap | None, tok: Tokenizer,
                     data: PackedData, eval_data: PackedData | None, started: float) -> list[float]:
    """Parallelize `model`, load its weights when it was built on meta (`wrap`: how its adapters were added), train,
    write OUT/model (merged, and OUT/adapter, with --lora-rank) and print the summary; the losses of the steps run."""
    parallelize_model(model, d, cfg.model, cfg.parallel)
    if on_meta:
        load_sharded(model, d, cfg.model, wrap)
    lora = cfg.lora.config()
    losses = train(cfg, d, model, data, eval_data, cfg.lora)
    export(cfg, d, model, tok, lora, cfg.data.template())
    summary(cfg, d, losses, started, adapter=lora is not None)
    return losses
