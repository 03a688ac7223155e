"""python -m zoo.generate CKPT --prompt TEXT | --chat: text from a checkpoint, printed as it is generated.

CKPT is a zoo or Hugging Face checkpoint directory with its tokenizer (tokenizer.json or tokenizer.model).
--prompt continues a text (after the tokenizer's bos token). --chat reads one user message per line from stdin and
answers each through the checkpoint's chat template, the conversation so far being the prompt. Generation stops at
the checkpoint's eos ids, the tokenizer's eos or the chat template's end-of-turn token, or after --max-new-tokens.
Bad input is one line on stderr (`error: ...`) and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, TextIO

import torch
from torch import Tensor

from zoo.errors import ZooError
from zoo.generate import generate
from zoo.io import dtypes
from zoo.io.load import load
from zoo.io.tokenizer import Message, Tokenizer, render
from zoo.models import Model

DTYPES: dict[str, torch.dtype | None] = {"auto": None, **dtypes.DTYPES}  # --dtype: auto, then zoo's full names


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit code 2, like every other bad input
        raise ZooError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m zoo.generate", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("checkpoint", help="checkpoint directory (zoo or Hugging Face) with its tokenizer")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="text to continue")
    mode.add_argument("--chat", action="store_true", help="chat: one user message per line of stdin")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampling")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens holding p")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N; auto (default): cuda when available")
    p.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="weights' dtype; auto (default): bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="run each decoding step through torch.compile (CUDA graphs on CUDA; the first answer waits "
                        "for the compilation, seconds); auto (default): on CUDA only")
    return p.parse_args(argv)


class Printer:
    """Prints the text of a sequence's tokens as they come (generate's on_token). Each step decodes the tokens so
    far and prints what is new; an incomplete UTF-8 character (decoded as U+FFFD) waits for its last byte. Stop
    tokens are not printed."""

    def __init__(self, tok: Tokenizer, stop: tuple[int, ...], out: TextIO) -> None:
        self.tok, self.stop, self.out = tok, set(stop), out
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, token_n: Tensor) -> None:
        token = int(token_n[0])
        if token in self.stop:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._show(text)

    def _show(self, text: str) -> None:
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def finish(self) -> str:
        """The whole text, its rest printed, then a newline."""
        text = self.tok.decode(self.ids)
        self._show(text)
        self.out.write("\n")
        self.out.flush()
        return text


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ZooError(f"--device {name}: expected cpu, cuda or cuda:N ({e})") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ZooError(f"--device {name}, but CUDA is not available on this machine; use --device cpu")
    return device


def _lines(stdin: TextIO) -> Iterator[str]:
    if not stdin.isatty():
        yield from stdin
        return
    while True:  # a terminal: input() gives line editing and a prompt
        try:
            yield input("> ")
        except EOFError:
            print()
            return


def run(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
    """Load the checkpoint and its tokenizer, then answer the prompt or chat (see the module docstring)."""
    if args.max_new_tokens < 1:
        raise ZooError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not Path(args.checkpoint).is_dir():
        raise ZooError(f"{args.checkpoint} is not a directory: expected a checkpoint directory (config.json, "
                       "*.safetensors and the tokenizer)")
    tok = Tokenizer(args.checkpoint)  # first: a missing tokenizer fails before any weight is read
    device = _device(args.device)
    dtype = DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model: Model = load(args.checkpoint, dtype=dtype, device=device)
    vocab = model.head_weight.shape[0]
    if tok.vocab_size > vocab:
        raise ZooError(f"the tokenizer in {args.checkpoint} has {tok.vocab_size} tokens but the model's vocabulary "
                       f"is {vocab}: not this model's tokenizer")
    stop = tuple(dict.fromkeys([*model.eos_token_ids, *tok.stop_ids()]))

    def answer(ids: list[int]) -> str:
        printer = Printer(tok, stop, stdout)
        generate(model, [torch.tensor(ids)], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, stop=stop, seed=args.seed, on_token=printer,
                 compile={"auto": None, "on": True, "off": False}[args.compile])
        return printer.finish()

    if not args.chat:
        ids = tok.encode(args.prompt)
        if tok.bos_id is not None and ids[:1] != [tok.bos_id]:
            ids = [tok.bos_id, *ids]
        if not ids:
            raise ZooError("--prompt is empty and the tokenizer has no bos token to start from")
        answer(ids)
        return
    messages: list[Message] = []
    for line in _lines(stdin):
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        text = render(messages, "auto", tok, add_generation_prompt=True).text
        messages.append({"role": "assistant", "content": answer(tok.encode(text))})


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """The command line; returns the exit code (2 for bad input, with one line on stderr)."""
    try:
        run(parse_args(argv), stdin or sys.stdin, stdout or sys.stdout)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
