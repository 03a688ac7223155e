"""python -m zoo.generate CKPT --prompt TEXT | --chat: text from a checkpoint, printed as it is generated.

CKPT is a zoo or Hugging Face checkpoint directory with its tokenizer (tokenizer.json or tokenizer.model).
--prompt continues a text, encoded as transformers' tokenizer(text) encodes it (`Tokenizer.encode(text)`: the
special tokens the checkpoint adds, its bos for Llama and zoo's bundled tokenizer, nothing for Qwen), so
`generate(model, [torch.tensor(tok.encode(text))])` from Python continues it alike. It prints the text and
then its continuation. --chat reads one user message per line from stdin and answers each through the checkpoint's
chat template, the conversation so far being the prompt (opened by --system's message, with --tools' schemas and
--chat-template-kwargs' switches, as transformers' apply_chat_template passes them); a line `/reset` starts it over.
Images (a vision-language checkpoint: LLaVA, Qwen2.5-VL, Gemma 3): --image FILE, repeatable, makes --prompt a user
message holding the images, then the text (content items `{"type": "image"}` and `{"type": "text"}`), rendered with
the checkpoint's chat template and answered (the answer alone is printed); with --chat the images go with the first
message, and a line `/image FILE` attaches an image to the next message. Each image's placeholder in the rendered
text is expanded as the checkpoint's processor expands it (`model.expand_placeholders`), the image prepared by
zoo.io.image.preprocess; every image of the conversation so far goes with each answer's prompt.
Generation stops at the checkpoint's eos ids, the tokenizer's eos or the chat template's end-of-turn token, or after
--max-new-tokens.
Sampling follows the checkpoint's generation_config.json where no flag is given, as transformers' generate does:
do_sample false or absent is greedy; do_sample true samples with its temperature, top_k and top_p (transformers'
defaults where it names none: 1.0, 50, 1.0); its repetition_penalty applies either way. --temperature, --top-k,
--top-p and --repetition-penalty override it (--temperature 0: greedy).
Bad input is one line on stderr (`error: ...`) and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from PIL import Image
from torch import Tensor

from zoo.errors import ArgumentParser, ZooError
from zoo.generate import MIN_TEMPERATURE, generate
from zoo.io import dtypes
from zoo.io.config import generation_sampling
from zoo.io.hub import is_hub_id, resolve
from zoo.io.image import open_image, preprocess
from zoo.io.json_input import check_switches, load_json_bounded, read_bounded
from zoo.io.load import load
from zoo.io.tokenizer import Message, Tokenizer, render
from zoo.models import Model
from zoo.models.vlm import VisionLanguage

DTYPES: dict[str, torch.dtype | None] = {"auto": None, **dtypes.DTYPES}  # --dtype: auto, then zoo's full names


MAX_TOOLS_BYTES = 1 << 20  # --tools: see chat_template_input
RESET = "/reset"  # a --chat line that starts the conversation over (the --system message kept)
IMAGE = "/image"  # a --chat line `/image FILE`: the image goes with the next user message


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m zoo.generate", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("checkpoint", help="checkpoint directory (zoo or Hugging Face) with its tokenizer, or a Hugging "
                                      "Face hub id ORG/NAME in the local cache (HF_HUB_CACHE, HF_HOME)")
    p.add_argument("--revision", default=None, help="CKPT as a hub id: the branch, tag or commit of its snapshot "
                                                    "(default main)")
    p.add_argument("--download", action="store_true", help="CKPT as a hub id not in the cache: download it through "
                   "huggingface_hub (safetensors, configs, tokenizer files; never with HF_HUB_OFFLINE set)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="text to continue")
    mode.add_argument("--chat", action="store_true", help="chat: one user message per line of stdin")
    p.add_argument("--image", metavar="FILE", action="append", default=None,
                   help="an image for a vision-language checkpoint (repeatable, in order): --prompt becomes a user "
                        "message of the images then the text, rendered with the checkpoint's chat template; with "
                        "--chat the images go with the first message (a line `/image FILE` attaches one later)")
    p.add_argument("--system", metavar="TEXT", help="--chat: a system message that opens the conversation (kept by "
                                                    "/reset)")
    p.add_argument("--tools", metavar="FILE", help="--chat: a JSON file holding a list of tool schemas, given to the "
                                                   "chat template as transformers' apply_chat_template(tools=...)")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="--chat: switches for the chat template as a JSON object, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy; else sampling (default: the checkpoint's generation_config.json: its temperature "
                        "where do_sample is true, else greedy)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the k most likely tokens; 0: all (default: generation_config.json's top_k; 50 "
                        "where it turns sampling on and names none, as transformers)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens holding p; 1: all (default: generation_config.json's "
                        "top_p, else 1)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide the positive logits of tokens already in the text by this, multiply the negative "
                        "ones; 1: none (default: generation_config.json's repetition_penalty, else 1)")
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


def _check_flags(args: argparse.Namespace) -> None:
    """Each flag's range, in the flag's own words (generate() would name its keyword instead)."""
    if args.max_new_tokens < 1:
        raise ZooError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    t = args.temperature
    if t is not None and not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
        raise ZooError(f"--temperature {t}: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (sampling)")
    if args.top_k is not None and args.top_k < 0:
        raise ZooError(f"--top-k {args.top_k}: expected an integer >= 1 (or 0: no top-k filtering)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ZooError(f"--top-p {args.top_p}: top_p must be a number in (0, 1] (1: no top-p filtering)")
    r = args.repetition_penalty
    if r is not None and not 0 < r < math.inf:
        raise ZooError(f"--repetition-penalty {r}: expected a finite number above 0 (1: none)")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise ZooError(f"--seed {args.seed}: expected an integer in 0..2**64-1")
    if args.prompt is not None:
        _utf8(args.prompt, "--prompt")
        if args.tools is not None or args.chat_template_kwargs is not None or args.system is not None:
            raise ZooError("--system, --tools and --chat-template-kwargs apply to --chat only (a --prompt is not a "
                           "chat)")


def chat_template_input(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """--tools' schemas and --chat-template-kwargs' switches, each refused in one line unless well-formed."""
    tools = None
    if args.tools is not None:
        path = Path(args.tools)
        # tool schemas are a few KB each; 1 MB is hundreds of tools, and all of them go into every prompt
        raw = read_bounded(path, "--tools", MAX_TOOLS_BYTES)
        try:
            tools = load_json_bounded(raw.decode("utf-8"), f"--tools {path}")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ZooError(f"--tools {path}: expected a JSON list of tool schemas, got text that is not JSON "
                           f"({e})") from e
        if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ZooError(f"--tools {path}: expected a JSON list of tool schemas (objects), got "
                           f"{json.dumps(tools)[:80]}")
    switches: Any = {}
    if args.chat_template_kwargs is not None:
        try:
            switches = load_json_bounded(args.chat_template_kwargs, "--chat-template-kwargs")
        except json.JSONDecodeError as e:
            raise ZooError(f"--chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs[:80]!r} "
                           f"({e.msg})") from e
        if not isinstance(switches, dict):
            raise ZooError(f"--chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs[:80]!r}")
        check_switches(switches, "--chat-template-kwargs")
    return tools, switches


@dataclass(frozen=True)
class Decoding:
    """generate()'s decoding keywords."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0


def decoding(args: argparse.Namespace, checkpoint: str) -> Decoding:
    """The flags given, else the checkpoint's generation_config.json as transformers' generate reads it (do_sample
    false or absent: greedy; true: its temperature, top_k, top_p, transformers' 1.0, 50 and 1.0 where it names
    none; its repetition_penalty either way). top_k 0 and top_p 1 filter nothing (None)."""
    gen = generation_sampling(checkpoint)
    penalty = float(args.repetition_penalty if args.repetition_penalty is not None
                    else gen.get("repetition_penalty", 1.0))
    from_file = args.temperature is None and bool(gen.get("do_sample"))
    if args.temperature is not None:
        temperature = args.temperature
    else:
        temperature = float(gen.get("temperature", 1.0)) if from_file else 0.0
        if 0 < temperature < MIN_TEMPERATURE:
            raise ZooError(f"{Path(checkpoint) / 'generation_config.json'}: temperature {temperature} is below "
                           f"{MIN_TEMPERATURE}, where sampling overflows; pass --temperature")
    if temperature == 0:
        return Decoding(repetition_penalty=penalty)
    top_k = args.top_k if args.top_k is not None else gen.get("top_k", 50 if from_file else None)
    top_p = args.top_p if args.top_p is not None else gen.get("top_p")
    return Decoding(temperature, top_k or None, None if top_p is None or top_p >= 1 else float(top_p), penalty)


def checkpoint_dir(args: argparse.Namespace) -> Path:
    """CKPT: a directory, or a Hugging Face hub id's snapshot in the local cache (--revision, --download); a preset
    name (any case) says generation needs weights and where they are published."""
    name = args.checkpoint
    if Path(name).is_dir() or (is_hub_id(name) and not Path(name).exists()):
        return resolve(name, args.revision, args.download, "--download", "CKPT")
    msg = f"{name} is not a directory: expected a checkpoint directory (config.json, *.safetensors and the tokenizer)"
    from zoo.models.presets import PRESETS

    preset = PRESETS.get(name.lower())
    if preset is not None and not Path(name).exists():
        source = f" ({preset.hf_source}, once in the Hugging Face cache)" if preset.hf_source else ""
        msg += f"; {name!r} is a preset, which has random weights: pass its checkpoint{source}"
    raise ZooError(msg)


def _utf8(text: str, where: str) -> str:
    """`text` when it is text; bytes that were not UTF-8 reach Python as lone surrogates (surrogateescape, as in
    argv and a C-locale stdin), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ZooError(f"{where}: expected UTF-8 text, got byte {ord(text[e.start]) & 0xFF:#04x} at column "
                       f"{e.start + 1}") from e
    return text


def _lines(stdin: TextIO) -> Iterator[str]:
    """stdin's lines, each checked to be UTF-8 text."""
    n = 1
    try:
        if not stdin.isatty():
            for n, line in enumerate(stdin, 1):
                yield _utf8(line, f"stdin line {n}")
            return
        while True:  # a terminal: input() gives line editing and a prompt
            try:
                yield _utf8(input("> "), f"stdin line {n}")
            except EOFError:
                print()
                return
            n += 1
    except UnicodeDecodeError as e:  # a stdin decoding strictly
        raise ZooError(f"stdin line {n}: expected UTF-8 text, got byte {e.object[e.start]:#04x}") from e


def _user(text: str, images: int) -> Message:
    """A user message: its text alone, or `images` image items then the text (transformers' content items)."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*[{"type": "image"}] * images, {"type": "text", "text": text}]}


def _vision(model: Model, where: str) -> VisionLanguage:
    if not isinstance(model, VisionLanguage):
        raise ZooError(f"{where}: a {model.family} model takes no images; pass a vision-language checkpoint "
                       "(LLaVA, Qwen2.5-VL, Gemma 3)")
    return model


def _has_template(tok: Tokenizer, where: str) -> None:
    if not tok.chat_template:
        raise ZooError(f"{where}: images go into the prompt through the checkpoint's chat template, and {tok.dir} has "
                       "none (chat_template.jinja, tokenizer_config.json or chat_template.json)")


def run(args: argparse.Namespace, stdin: TextIO, stdout: TextIO) -> None:
    """Load the checkpoint and its tokenizer, then answer the prompt or chat (see the module docstring)."""
    _check_flags(args)
    tools, switches = chat_template_input(args)
    args.checkpoint = str(checkpoint_dir(args))
    tok = Tokenizer(args.checkpoint)  # first: a missing tokenizer fails before any weight is read
    how = decoding(args, args.checkpoint)
    pending = [open_image(path, f"--image {path}") for path in args.image or []]  # before the weights, too
    if pending:
        _has_template(tok, "--image")
    device = _device(args.device)
    dtype = DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model: Model = load(args.checkpoint, dtype=dtype, device=device)
    vocab = model.head_weight.shape[0]
    if tok.vocab_size > vocab:
        raise ZooError(f"the tokenizer in {args.checkpoint} has {tok.vocab_size} tokens but the model's vocabulary "
                       f"is {vocab}: not this model's tokenizer")
    if pending:
        _vision(model, "--image")
    stop = tuple(dict.fromkeys([*model.eos_token_ids, *tok.stop_ids()]))

    def answer(ids: list[int], images: Any = None) -> str:
        printer = Printer(tok, stop, stdout)
        generate(model, [torch.tensor(ids)], max_new_tokens=args.max_new_tokens, **asdict(how), stop=stop,
                 seed=args.seed, on_token=printer, images=None if images is None else [images],
                 compile={"auto": None, "on": True, "off": False}[args.compile])
        return printer.finish()

    def prompt(messages: list[Message], shown: list[Any]) -> tuple[list[int], Any]:
        """The conversation's ids to answer, with its images (model-ready, in order) expanded into them."""
        text = render(messages, "auto", tok, add_generation_prompt=True, tools=tools, **switches).text
        if not shown:
            return tok.encode(text, add_special_tokens=False), None
        vlm = _vision(model, "--image")
        if tok.token_to_id(vlm.placeholder) is None:
            raise ZooError(f"the tokenizer in {args.checkpoint} has no {vlm.placeholder} token, where "
                           f"{model.family}'s processor puts an image")
        images = _to(preprocess(model, shown), device, dtype)
        return tok.encode(vlm.expand_placeholders(text, images), add_special_tokens=False), images

    if not args.chat and not pending:
        ids = tok.encode(args.prompt)  # the checkpoint's special tokens, as transformers adds them
        if not ids:
            raise ZooError("--prompt is empty and the tokenizer adds no bos token to start from")
        stdout.write(args.prompt)  # the text, then its continuation streamed right after it
        stdout.flush()
        answer(ids)
        return
    if not args.chat:
        answer(*prompt([_user(args.prompt, len(pending))], pending))
        return
    opening: list[Message] = [] if args.system is None else [{"role": "system", "content": _utf8(args.system,
                                                                                                  "--system")}]
    messages, shown = list(opening), list[Image.Image]()  # shown: the images of the messages so far, in order
    for line in _lines(stdin):
        if not line.strip():
            continue
        if line.strip() == RESET:
            messages, shown, pending = list(opening), [], []
            stdout.write("(a new conversation)\n")
            continue
        if line.strip().startswith(IMAGE + " ") or line.strip() == IMAGE:
            path = line.strip()[len(IMAGE):].strip()
            if not path:
                raise ZooError(f"{IMAGE}: expected `{IMAGE} FILE`, an image file for the next message")
            _vision(model, f"{IMAGE} {path}")
            _has_template(tok, f"{IMAGE} {path}")
            pending.append(open_image(path, f"{IMAGE} {path}"))
            stdout.write(f"(image {path} goes with the next message)\n")
            continue
        messages.append(_user(line.strip(), len(pending)))
        shown, pending = shown + pending, []
        messages.append({"role": "assistant", "content": answer(*prompt(messages, shown))})


def _to(images: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Preprocessed images on the model's device, their pixels in its dtype (transformers casts them so too)."""
    if isinstance(images, Tensor):
        return images.to(device, dtype)
    return dataclasses.replace(images, pixel_values=images.pixel_values.to(device, dtype))


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
