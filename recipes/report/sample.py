"""Sample generations while training (--sample-every N): greedy continuations of fixed prompts, on the training
model, printed on rank 0 and written to the step's row of metrics.jsonl as "samples": [{"prompt", "text"}].

A pretraining run continues raw text, encoded as `python -m zoo.generate --prompt` encodes it (the checkpoint's
special tokens, as its documents start: recipes/data/text.py); a chat recipe (its data section has a chat template:
sft, dpo, llava) renders each prompt as a user turn through its template. Every rank runs the same forwards (FSDP
gathers each block collectively, as in the loop's evaluation): the prompts are the same everywhere, decoding is
greedy and never stops early, so all ranks step together; the root's own weights (embeddings, head) are gathered
around it, since a decode step reads them outside the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zoo.core.attention import AttentionFn
from zoo.errors import ZooError
from zoo.generate import generate
from zoo.io.tokenizer import Tokenizer, render
from zoo.models import Model

PRETRAIN_PROMPTS = ("The meaning of", "Python is")
CHAT_PROMPTS = ("What is Python?", "Write one sentence about the sea.")

# what takes off an attention wrapper a recipe installs for training only (DPO's shared-prompt gathering): given an
# attention function, the one that wrapper wraps, or None when it is no such wrapper
Unwrap = Callable[[AttentionFn], AttentionFn | None]


class Sampler:
    """The prompts of --sample-prompts (or the recipe's two defaults) as token ids, and their greedy continuation
    every --sample-every steps: `template` is the chat template a chat recipe renders them with (None: raw text),
    `prompts_file` --sample-prompts, `unwrap` what the recipe wraps the model's attention in for training only."""

    def __init__(self, tok: Tokenizer, template: str | None, every: int, max_new_tokens: int,
                 prompts_file: str | None = None, unwrap: Unwrap | None = None) -> None:
        self.every, self.max_new_tokens, self.tok, self.unwrap = every, max_new_tokens, tok, unwrap
        self.prompts = read_prompts(prompts_file) if prompts_file else list(
            PRETRAIN_PROMPTS if template is None else CHAT_PROMPTS)
        self.ids = [prompt_ids(tok, p, template) for p in self.prompts]
        self.stop = set(tok.stop_ids(template or "auto")) if template else {i for i in [tok.eos_id] if i is not None}

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

    def __call__(self, model: Model, device: torch.device, fsdp: bool) -> list[dict[str, str]]:
        """[{"prompt", "text"}] of every prompt, the text cut before its first stop token; `fsdp`: the model may be
        sharded by FSDP."""
        backend = model.attend
        model.set_attention(plain_backend(backend, self.unwrap))
        root = None
        if fsdp:
            from torch.distributed.fsdp import FSDPModule

            root = model if isinstance(model, FSDPModule) else None
        was_training = model.training
        model.eval()
        try:
            if root is not None:
                root.unshard()
            with torch.no_grad():
                out = generate(model, [torch.tensor(ids, device=device) for ids in self.ids],
                               max_new_tokens=self.max_new_tokens, stop=[], compile=False)
        finally:
            if root is not None:
                root.reshard()
            model.train(was_training)
            model.set_attention(backend)
        samples = []
        for prompt, new in zip(self.prompts, out, strict=True):
            ids = new.tolist()
            cut = next((k for k, i in enumerate(ids) if i in self.stop), len(ids))
            samples.append({"prompt": prompt, "text": self.tok.decode(ids[:cut])})
        return samples


def plain_backend(attend: AttentionFn, unwrap: Unwrap | None = None) -> AttentionFn:
    """The model's own attention function under the wrappers installed for training: sequence parallelism
    (generation runs whole prompts on every rank) and those the recipe's `unwrap` knows (DPO's shared-prompt
    gathering, which takes no positional `scale`, as the KV cache passes it). Each passes a plain pack through
    already; generation runs without them. A Gated DeltaNet layer needs nothing: under generate() its cache takes
    precedence over its sequence-parallel exchange (zoo.core.mixer.Mixer)."""
    from zoo.parallel.sequence import SequenceParallelAttention

    while True:
        if isinstance(attend, SequenceParallelAttention):
            attend = attend.backend
        elif unwrap is not None and (inner := unwrap(attend)) is not None:
            attend = inner
        else:
            return attend


def prompt_ids(tok: Tokenizer, prompt: str, template: str | None) -> list[int]:
    """A chat prompt as a user turn ending in the assistant's header (the template writes its special tokens);
    raw text with the checkpoint's, as the generation CLI's --prompt and the pretraining documents have them."""
    if template is not None:
        text = render([{"role": "user", "content": prompt}], template, tok, add_generation_prompt=True).text
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt)


def read_prompts(path: str) -> list[str]:
    """The non-empty lines of --sample-prompts."""
    f = Path(path)
    if not f.is_file():
        raise ZooError(f"--sample-prompts {path}: expected a text file with one prompt a line, found none there")
    prompts = [line for line in f.read_text(errors="replace").splitlines() if line.strip()]
    if not prompts:
        raise ZooError(f"--sample-prompts {path}: expected one prompt a line, the file has none")
    return prompts


def sample_lines(samples: list[dict[str, Any]]) -> str:
    """The printed form: one line per prompt, its text on the same line."""
    return "\n".join(f"  sample {p['prompt']!r} -> {p['text']!r}" for p in samples)
