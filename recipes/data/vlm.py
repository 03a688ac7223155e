"""Vision-language data for recipes.vlm: TRL's conversational rows with images, or LLaVA's JSON, rendered with the
checkpoint's chat template, every image's placeholder expanded as the checkpoint's processor expands it, loss on the
assistant tokens only (never on an image's), samples packed whole by first-fit decreasing with their image tokens
counted.

A TRL row (JSONL, or a JSON list) is {"messages": [{"role", "content": [{"type": "image"}, {"type": "text", "text":
...}]}], "images": ["cat.png", ...]}: one image part per entry of "images", in order, paths relative to the data
file's folder (or --image-folder); string content is text alone. A LLaVA row ({"conversations": [{"from", "value"}],
"image"}) becomes the same messages, each "<image>" an image part. Only each image's size is read when the data is
read (its file's header: the model's `image_tokens` counts its tokens from it), so each sample's length is known
before the run; its pixels are decoded and preprocessed once, when its pack is built (pixels are not held).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from recipes.data.chat import ROLES
from recipes.data.jsonl import JSONObject
from recipes.data.llava import image_path, llava_messages, read_llava
from recipes.data.packs import PackedData, describe_stats, first_fit_decreasing
from zoo import Packed, ZooError, pack
from zoo.io.chat import Message, render
from zoo.io.tokenizer import Tokenizer

# the text of one conversation with its images' placeholders -> that text as the checkpoint's processor expands it
# (of images of these (height, width) pixels)
Expand = Callable[[str, Sequence[tuple[int, int]]], str]
Preprocess = Callable[[list[Image.Image]], Any]  # PIL images -> what zoo.pack's images take for one document
Source = Path | Image.Image  # an image file, or a built-in image


def is_image_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def check_parts(f: Path, n: int, k: int, m: JSONObject) -> None:
    """Message k's content: a string, or a list of {"type": "image"} and {"type": "text", "text": str} parts."""
    content = m.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not all(
            is_image_part(p) or (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
            for p in content):
        raise ZooError(f"{f}:{n}: expected message {k}'s content as a string or a list of {{\"type\": \"image\"}} "
                       f"and {{\"type\": \"text\", \"text\": ...}} parts, got {json.dumps(content)[:120]}")
    if m["role"] != "user" and any(is_image_part(p) for p in content):
        raise ZooError(f"{f}:{n}: message {k} ({m['role']}) holds an image; images go in user turns (an image is "
                       "never a target)")


def row_messages(f: Path, n: int, row: JSONObject) -> tuple[list[Message], list[object]]:
    """(messages with image parts, the row's image names in order) of a TRL row or a LLaVA row."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and m.get("role") in ROLES for m in msgs):
            raise ZooError(f"{f}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}], \"images\": "
                           f"[...]}} with roles {', '.join(ROLES)}, got {json.dumps(row)[:120]}")
        for k, m in enumerate(msgs):
            check_parts(f, n, k, m)
        names = row.get("images")
        names = [] if names is None else [names] if isinstance(names, str) else names
        if not isinstance(names, list):
            raise ZooError(f"{f}:{n}: expected \"images\" as a list of paths, got {json.dumps(row['images'])[:120]}")
    elif "conversations" in row:
        msgs = [{"role": m["role"], "content": llava_parts(m["content"])} for m in llava_messages(f, n, row)]
        names = [] if row.get("image") is None else [row["image"]]
    else:
        raise ZooError(f"{f}:{n}: expected a TRL row {{\"messages\": [...], \"images\": [...]}} or a LLaVA row "
                       f"{{\"conversations\": [...], \"image\": ...}}, got keys {sorted(map(str, row))[:8]}")
    parts = sum(is_image_part(p) for m in msgs if isinstance(m["content"], list) for p in m["content"])
    if parts != len(names):
        raise ZooError(f"{f}:{n}: the messages hold {parts} image placeholder(s) ({{\"type\": \"image\"}} parts or "
                       f"<image>) but the row names {len(names)} image(s); expected one placeholder per image")
    return msgs, names


def llava_parts(text: str) -> list[JSONObject]:
    """LLaVA's text with <image> as content parts: an image part for each <image>, the text around it."""
    parts: list[JSONObject] = []
    for k, piece in enumerate(text.split("<image>")):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def open_image(path: Path, decode: bool = True) -> Image.Image:
    """The image at `path`, decoded (or, without `decode`, its header alone read: its size); a file Pillow cannot
    read, or one whose header claims more pixels than Pillow's bound (a decompression bomb), is a ZooError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # Pillow only warns below twice its bound
            with Image.open(path) as im:
                if decode:
                    im.load()
                return im
    except (OSError, Image.DecompressionBombError, Image.DecompressionBombWarning, SyntaxError, ValueError) as e:
        raise ZooError(f"{path}: not an image Pillow can read ({type(e).__name__}: {str(e)[:200]})") from e


def image_size(source: Source) -> tuple[int, int]:
    """(height, width) of an image, from a file's header only (no pixel decoded)."""
    w, h = (source if isinstance(source, Image.Image) else open_image(source, decode=False)).size
    return h, w


def assistant_spans(text: str, expanded: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The assistant spans of `text` located in its expansion: the expansion only inserts image tokens in user
    turns, so each span is found again, in order, at or after its own offset (an answer ends with an end-of-turn
    token, which no image's tokens hold)."""
    out, at = [], 0
    for a, b in spans:
        where = expanded.find(text[a:b], max(at, a))
        if where < 0:
            raise ZooError(f"an assistant turn {text[a:b][:60]!r} is not in the text as the processor expands it")
        out.append((where, where + b - a))
        at = where + b - a
    return out


def encode(msgs: list[Message], sizes: Sequence[tuple[int, int]], template: str, tok: Tokenizer,
           expand: Expand) -> tuple[list[int], list[bool]]:
    """(ids, is_target) of one conversation with its images (their (height, width) sizes): rendered, expanded,
    tokenized in one piece; targets are the tokens of the assistant turns."""
    chat = render(msgs, template, tok)
    expanded = expand(chat.text, sizes)
    spans = assistant_spans(chat.text, expanded, chat.spans)
    ids, offsets = tok.encode_with_offsets(expanded)
    mask, j = [], 0
    for a, b in offsets:
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        mask.append(j < len(spans) and spans[j][0] < b and a < spans[j][1])
    return ids, mask


def image_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `image_token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == image_token_id:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs


COLORS = {"red": (230, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 250), "yellow": (250, 230, 30),
          "black": (0, 0, 0), "white": (255, 255, 255)}


def synthetic_rows(n: int, sizes: Sequence[tuple[int, int]], seed: int = 0) -> list[tuple[JSONObject, Image.Image]]:
    """The built-in set: a colored square on a colored background, images of mixed `sizes` (width, height), and
    questions about the colors, as TRL rows with their images."""
    names = sorted(COLORS)
    g = torch.Generator().manual_seed(seed)
    out: list[tuple[JSONObject, Image.Image]] = []
    for k in range(n):
        fg, bg = [names[int(i)] for i in torch.randperm(len(names), generator=g)[:2]]
        w, h = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        side = int(torch.randint(min(w, h) // 3, min(w, h) // 2 + 1, (1,), generator=g))
        x, y = int(torch.randint(0, w - side + 1, (1,), generator=g)), int(torch.randint(0, h - side + 1, (1,),
                                                                                        generator=g))
        img = Image.new("RGB", (w, h), COLORS[bg])
        img.paste(COLORS[fg], (x, y, x + side, y + side))
        question, answer = (("What color is the square?", f"The square is {fg}.") if k % 2 == 0 else
                            ("What color is the background?", f"The background is {bg}."))
        row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                            {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
               "images": [f"synthetic-{k}"]}
        out.append((row, img))
    return out


class VLMData(PackedData):
    """Chats with images packed whole by first-fit decreasing: `expand` writes each image's tokens as the
    checkpoint's processor does, `preprocess` makes its pixels when a pack is built."""

    def __init__(self, data: str | None, image_folder: str | None, tok: Tokenizer, seq_len: int, seed: int, *,
                 expand: Expand, preprocess: Preprocess, image_token_id: int, template: str = "auto",
                 overlong: str = "drop", synthetic: Sequence[tuple[JSONObject, Image.Image]] = ()):
        super().__init__(seed)
        self.preprocess = preprocess
        rows: list[tuple[Path, int, JSONObject, list[Image.Image] | None]]  # (file, number, row, built-in images)
        if data is None:
            rows = [(Path("<synthetic>"), n, row, [img]) for n, (row, img) in enumerate(synthetic, 1)]
        else:
            rows = [(f, n, row, None) for f, n, row in read_llava(data)]
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.images: list[list[Source]] = []  # each sample's images, or where they are read from
        stats = {"samples": 0, "no_assistant": 0, "truncated": 0, "dropped": 0, "images": 0}
        for f, n, row, builtin in rows:
            msgs, names = row_messages(f, n, row)
            stats["samples"] += 1
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant"] += 1
                continue
            folder = Path(image_folder) if image_folder else f.parent
            sources: list[Source] = list(builtin) if builtin is not None else [
                image_path(f, n, folder, name, image_folder) for name in names]
            # the processor's token counts (Qwen's depend on each image's size) from the files' headers: each image
            # is decoded and preprocessed once, when its pack is built
            try:
                ids, mask = encode(msgs, [image_size(s) for s in sources], template, tok, expand)
            except ZooError as e:
                raise ZooError(f"{f}:{n}: {e}") from e
            runs = image_runs(ids, image_token_id)
            if len(runs) != len(sources):
                raise ZooError(f"{f}:{n}: the rendered text holds {len(runs)} run(s) of image tokens (id "
                               f"{image_token_id}) for {len(sources)} image(s): the chat template must write one "
                               "placeholder per {\"type\": \"image\"} part")
            if len(ids) > seq_len:  # an image's tokens count: a sample never cuts one apart
                last = runs[-1][1] if runs else 0
                if overlong == "drop" or last + 1 >= seq_len or not any(mask[last:seq_len]):
                    stats["dropped"] += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                stats["truncated"] += 1
            stats["images"] += len(sources)
            self.samples.append((torch.tensor(ids), torch.tensor(mask)))
            self.images.append(sources)
        if not self.samples:
            raise ZooError(f"no usable vision-language samples in {data or 'the built-in set'}: "
                           f"{describe_stats(stats)}")
        self.items = first_fit_decreasing([len(ids) for ids, _ in self.samples], seq_len)
        self.loss_tokens = [sum(int(self.samples[j][1][1:].sum()) for j in b) for b in self.items]
        h = hashlib.sha256()
        for (ids_T, mask_T), srcs in zip(self.samples, self.images, strict=True):
            h.update(ids_T.numpy().tobytes() + mask_T.numpy().tobytes())
            h.update(repr([str(s) if isinstance(s, Path) else s.tobytes() for s in srcs]).encode())
        self.fingerprint = f"vlm:{seq_len}:{h.hexdigest()[:16]}"
        self.stats = {**stats, "used": len(self.samples), "packs": len(self.items),
                      "fill": round(sum(len(s[0]) for s in self.samples) / (len(self.items) * seq_len), 3)}

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        images = []
        for j in self.items[i]:
            loaded = [s if isinstance(s, Image.Image) else open_image(s) for s in self.images[j]]
            images.append(self.preprocess(loaded) if loaded else None)
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs], images=images)
