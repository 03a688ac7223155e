"""The torch internals zoo relies on, in one place: what each one is, what zoo uses it for, and what runs instead
where a torch release has removed or changed it (then one warning line, once per process and internal, under
`zoo.core.internals`). Nothing else in zoo touches `torch._*` or `torch.ops.aten._*`.

- `run_eagerly`: `torch._disable_dynamo` (torch.compiler.disable that imports torch._dynamo at the first call, not
  at decoration: `import zoo` stays a second faster). Public fallback: `torch.compiler.disable`.
- `mark_static_address`: `torch._dynamo.mark_static_address(t, guard=False)`, which lets CUDA graphs take buffers a
  compiled step writes in place at fixed addresses without guarding on them. Fallback: nothing marked (the graph is
  re-recorded when a buffer moves, slower but the same numbers).
- `flash_attention_backward`: `aten::_flash_attention_backward`, the ring's CUDA block backward (torch has no public
  varlen backward taking the final out and lse), checked against the schema zoo calls (torch 2.11-2.13).
  Fallback: the ring's dense fp32 math kernel (`zoo.parallel.ring_kernels`), which says so through `fallback`.
- `cpu_flash_attention`: `aten::_scaled_dot_product_flash_attention_for_cpu` and its backward, the fused CPU kernel
  sdpa runs, called directly for its lse. Fallback: the ring's dense fp32 math kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_WARNED: set[str] = set()


def fallback(internal: str, instead: str, why: str) -> None:
    """One warning line, once per `internal` in this process: zoo runs `instead` because `why`."""
    if internal in _WARNED:
        return
    _WARNED.add(internal)
    log.warning("zoo: %s unusable in torch %s (%s); running %s instead", internal, torch.__version__, why, instead)


def run_eagerly(fn: F) -> F:
    """`fn` run eagerly inside a compiled region (dynamo never traces it)."""
    disable = getattr(torch, "_disable_dynamo", None)
    if disable is None:
        fallback("torch._disable_dynamo", "torch.compiler.disable (imports torch._dynamo now)", "gone")
        return torch.compiler.disable(fn)
    return disable(fn)


def mark_static_address(t: torch.Tensor) -> None:
    """Tell a CUDA-graph compile that `t` stays at its address (written in place by the step), without a guard."""
    try:
        from torch._dynamo import mark_static_address as mark
    except ImportError as e:
        fallback("torch._dynamo.mark_static_address", "unmarked buffers (CUDA graphs re-recorded)", str(e))
        return
    mark(t, guard=False)


# the leading positional arguments of aten::_flash_attention_backward that zoo passes (torch 2.11-2.13)
FLASH_BACKWARD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q",
                       "max_k", "dropout_p", "is_causal", "rng_state", "unused"]


def flash_backward_problem() -> str | None:
    """Why `flash_attention_backward` is unusable in this torch, or None."""
    op = getattr(torch.ops.aten, "_flash_attention_backward", None)
    if op is None:
        return f"torch {torch.__version__} has no aten::_flash_attention_backward"
    schema = op.default._schema
    names = [a.name for a in schema.arguments]
    if names[: len(FLASH_BACKWARD_ARGS)] != FLASH_BACKWARD_ARGS or "scale" not in names:
        return f"torch {torch.__version__}'s aten::_flash_attention_backward is {schema}, not the layout zoo calls"
    return None


def flash_attention_backward() -> tuple[Callable[..., Any], list[str]] | None:
    """(aten::_flash_attention_backward, its argument names) where its schema is the one zoo calls, else None
    (the caller decides what runs instead and says so with `fallback`)."""
    if flash_backward_problem() is not None:
        return None
    op = torch.ops.aten._flash_attention_backward
    return op, [a.name for a in op.default._schema.arguments]


def cpu_flash_attention() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(forward, backward) of torch's fused CPU flash kernel, returning and taking the lse, or None."""
    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward") or \
            not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        fallback("aten::_scaled_dot_product_flash_attention_for_cpu", "the ring's dense fp32 math kernel on CPU",
                 "gone")
        return None
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward
