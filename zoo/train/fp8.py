"""fp8 training of a model's linear layers through torchao's float8 training (`torchao.float8`).

Each plain `nn.Linear` of the blocks becomes torchao's `Float8Linear`: its input, weight and output gradient cast to
float8 with dynamic scales (`tensorwise`: one scale per tensor, cuBLAS's kernel; `rowwise`: one per row, CUTLASS's
kernel, scales rounded to powers of two), the three matrix products of forward and backward in fp8, the weights and
their optimizer state as before. Left out, as torchtitan leaves them: the output head (its error would reach every
logit) and every layer whose in or out features are not multiples of 16 (what the fp8 kernels tile); subclasses of
nn.Linear (MoE routers, LoRA layers) are not plain linears and stay too. The parameters keep their names and
dtypes, so checkpoints, FSDP and the optimizer see the same model.

fp8 matrix products need a CUDA GPU of compute capability 8.9 or later (Ada, Hopper), bf16 activations (the recipes'
GPU default) and torchao installed; anywhere else `require_fp8` refuses in one line. It pays only with the blocks
compiled (torchao's casts are fused by inductor; eager, they cost more than fp8 saves).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from zoo.errors import ZooError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0) on
MULTIPLE = 16  # torch._scaled_mm wants both dims of each operand divisible by 16


def fp8_problem(recipe: str, device: torch.device | str, dtype: torch.dtype | None) -> str | None:
    """Why fp8 training with `recipe` cannot run on `device` with activations in `dtype`, or None if it can."""
    device = torch.device(device)
    if recipe not in RECIPES:
        return f"--fp8 must be one of {', '.join(RECIPES)}, got {recipe!r}"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"fp8 training needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper); this runs on {device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability < MIN_CAPABILITY:
        return (f"fp8 training needs compute capability >= 8.9 (Ada, Hopper); {torch.cuda.get_device_name(index)} "
                f"has {capability[0]}.{capability[1]}")
    if dtype != torch.bfloat16:
        return f"fp8 training runs under bf16 activations (--dtype bfloat16); this run computes in {dtype or 'fp32'}"
    if _float8() is None:
        return "fp8 training needs torchao (pip install torchao>=0.16): it does not import here"
    return None


def require_fp8(recipe: str, device: torch.device | str, dtype: torch.dtype | None) -> None:
    """A ZooError saying in one line why fp8 training cannot run here, or nothing."""
    problem = fp8_problem(recipe, device, dtype)
    if problem is not None:
        raise ZooError(problem)


def _float8():  # type: ignore[no-untyped-def]
    """torchao.float8, imported without torchao's import noise, or None."""
    try:
        from zoo.train.quant import import_torchao

        import_torchao()
        return importlib.import_module("torchao.float8")
    except ImportError:
        return None


def fp8_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Which linears take fp8 (torchao's module_filter_fn(module, fully qualified name)): plain nn.Linear with
    both dims multiples of 16, not the output head."""
    head = getattr(getattr(model, "decoder", model), "lm_head", None)

    def keep(module: nn.Module, name: str) -> bool:
        return (type(module) is nn.Linear and module is not head and name.rpartition(".")[2] != "lm_head"
                and module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0)

    return keep


def convert_fp8(model: nn.Module, recipe: str, device: torch.device | str | None = None,
                dtype: torch.dtype | None = torch.bfloat16, check: bool = True) -> tuple[int, int]:
    """Swap the model's eligible linears for torchao's Float8Linear with `recipe`'s scaling, in place; returns
    (converted, plain linears). `check` (the default) first refuses where fp8 cannot run (`require_fp8` on
    `device`, default the model's); check=False converts anyway (tests on CPU, where the matmuls cannot run)."""
    if check:
        require_fp8(recipe, device if device is not None else next(model.parameters()).device, dtype)
    elif recipe not in RECIPES:
        raise ZooError(f"--fp8 must be one of {', '.join(RECIPES)}, got {recipe!r}")
    float8 = _float8()
    if float8 is None:
        raise ZooError("fp8 training needs torchao (pip install torchao>=0.16): it does not import here")
    keep = fp8_filter(model)
    plain = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    chosen = {name for name, m in model.named_modules() if keep(m, name)}
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, name: name in chosen, config=config)
    return len(chosen), len(plain)


def is_fp8(module: nn.Module) -> bool:
    """Whether `module` is one of torchao's Float8Linear."""
    return type(module).__name__ == "Float8Linear"
