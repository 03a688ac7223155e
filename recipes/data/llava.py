"""LLaVA data: the LLaVA-Instruct layout (or built-in synthetic images), each <image> expanded to the tower's image
tokens, samples packed whole by first-fit decreasing."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from recipes.data.jsonl import JSONObject, list_files, read_jsonl
from recipes.data.packs import PackedData, describe_stats, first_fit_decreasing
from zoo import Packed, ZooError, pack
from zoo.io.paths import inside
from zoo.io.tokenizer import Message, Tokenizer, encode_chat
from zoo.models.clip import CLIPVisionConfig
from zoo.models.llava import LlavaConfig

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_llava(data: str) -> Iterator[tuple[Path, int, JSONObject]]:
    """LLaVA-Instruct samples from a .json list (the published layout) or .jsonl files; (file, number, sample)."""
    for f in list_files(data, (".json", ".jsonl")):
        if f.suffix == ".jsonl":
            yield from read_jsonl([f])
            continue
        try:
            rows = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ZooError(f"{f}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
        except UnicodeDecodeError as e:
            raise ZooError(f"{f}: not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start}); LLaVA data must "
                           "be UTF-8 JSON") from e
        except RecursionError as e:
            raise ZooError(f"{f}: JSON nested too deeply") from e
        if not isinstance(rows, list):
            raise ZooError(f"{f}: expected a JSON list of LLaVA samples, got {type(rows).__name__}")
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ZooError(f"{f}: sample {n} is a {type(row).__name__}, expected an object")
            yield f, n, row


def llava_messages(f: Path, n: int, row: JSONObject, image_text: str = "<image>") -> list[Message]:
    """LLaVA's {"conversations": [{"from": "human"|"gpt", "value"}]} as chat messages; <image> opens the first
    human turn when the sample has an image and the text does not place it."""
    conv = row.get("conversations")
    if not isinstance(conv, list) or not all(isinstance(c, dict) and c.get("from") in ROLES
                                             and isinstance(c.get("value"), str) for c in conv):
        raise ZooError(f"{f}:{n}: expected {{\"conversations\": [{{\"from\": \"human\"|\"gpt\", \"value\": ...}}]}}, "
                       f"got {json.dumps(row)[:120]}")
    msgs = [{"role": ROLES[c["from"]], "content": c["value"]} for c in conv]
    if row.get("image") is not None and not any(image_text in m["content"] for m in msgs):
        first = next((m for m in msgs if m["role"] == "user"), None)
        if first is not None:
            first["content"] = f"{image_text}\n{first['content']}"
    return msgs


def image_path(f: Path, n: int, folder: Path, name: object, image_folder: str | None) -> Path:
    """Where sample `n` of `f` reads its image: a regular file inside the image folder, never outside it (an
    absolute name, `..`, a symlink out)."""
    plain = isinstance(name, str) and name and not Path(name).is_absolute() and ".." not in Path(name).parts
    if plain and not (folder / str(name)).exists():
        raise ZooError(f"{f}:{n}: image {folder / str(name)} not found (--image-folder is {image_folder or 'not set'})")
    try:
        return inside(folder, name, "image", where="the image folder")
    except ZooError as e:
        raise ZooError(f"{f}:{n}: {e} (--image-folder is {image_folder or 'not set'})") from e


def load_image(path: Path, vision: CLIPVisionConfig) -> torch.Tensor:
    """[3, S, S] pixels: LLaVA-1.5's pad to square, then CLIP's preprocessing (needs Pillow). A file Pillow cannot
    read (OSError: unknown or truncated), or whose header claims more pixels than Pillow's bound (a decompression
    bomb), is a ZooError."""
    from PIL import Image

    from zoo.io.image import clip_preprocess

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # Pillow only warns below twice its bound
            with Image.open(path) as im:
                return clip_preprocess(im, size=vision.image_size, pad=True)
    except (OSError, Image.DecompressionBombError, Image.DecompressionBombWarning, SyntaxError, ValueError) as e:
        raise ZooError(f"{path}: not an image Pillow can read ({type(e).__name__}: {str(e)[:200]})") from e


def synthetic_shapes(n: int, vision: CLIPVisionConfig, seed: int = 0) -> list[tuple[JSONObject, torch.Tensor]]:
    """The built-in LLaVA set: a colored square on a colored background, and questions about its colors."""
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # zoo.io.image's
    colors = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.1, 0.2, 1.0), "yellow": (1.0, 0.9, 0.1),
              "black": (0.0, 0.0, 0.0), "white": (1.0, 1.0, 1.0)}
    names = sorted(colors)
    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor(clip_mean)[:, None, None]
    std = torch.tensor(clip_std)[:, None, None]
    out: list[tuple[JSONObject, torch.Tensor]] = []
    S = vision.image_size
    for _ in range(n):
        fg, bg = [names[int(i)] for i in torch.randperm(len(names), generator=g)[:2]]
        side = int(torch.randint(S // 3, S // 2 + 1, (1,), generator=g))
        y, x = (int(v) for v in torch.randint(0, S - side + 1, (2,), generator=g))
        img = torch.tensor(colors[bg])[:, None, None].repeat(1, S, S)
        img[:, y : y + side, x : x + side] = torch.tensor(colors[fg])[:, None, None]
        question = ["What color is the square?", "What color is the background?"][len(out) % 2]
        answer = f"The square is {fg}." if len(out) % 2 == 0 else f"The background is {bg}."
        row = {"image": f"synthetic-{len(out)}",
               "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]}
        out.append((row, ((img - mean) / std).float()))
    return out


class LlavaData(PackedData):
    """LLaVA-Instruct samples packed whole by first-fit decreasing, each <image> expanded to the tower's tokens."""

    def __init__(self, data: str | None, image_folder: str | None, tok: Tokenizer, seq_len: int, seed: int,
                 model_config: LlavaConfig, template: str = "auto", overlong: str = "drop", synthetic: int = 512):
        super().__init__(seed)
        self.vision, image = model_config.vision, ("<image>", model_config.image_token_id, model_config.image_tokens)
        rows: list[tuple[Path, int, JSONObject, torch.Tensor | None]]  # (file, number, sample, its built-in image)
        if data is None:
            rows = [(Path("<synthetic>"), n, row, pixels)
                    for n, (row, pixels) in enumerate(synthetic_shapes(synthetic, self.vision, seed), 1)]
        else:
            rows = [(f, n, row, None) for f, n, row in read_llava(data)]
        folder = Path(image_folder) if image_folder else (Path(data).parent if data else None)
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.images: list[torch.Tensor | Path | None] = []  # a sample's pixels, or where they are read from
        stats = {"samples": 0, "no_assistant": 0, "truncated": 0, "dropped": 0, "images": 0}
        for f, n, row, pixels in rows:
            msgs = llava_messages(f, n, row)
            stats["samples"] += 1
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant"] += 1
                continue
            ids, mask = encode_chat(msgs, template, tok, image if row.get("image") is not None else None)
            n_img = sum(m["content"].count("<image>") for m in msgs)
            if row.get("image") is None and n_img:
                raise ZooError(f"{f}:{n}: the text has <image> but the sample names no image")
            if n_img > 1:
                raise ZooError(f"{f}:{n}: {n_img} <image> placeholders for one image")
            if len(ids) > seq_len:
                # truncating could cut an image's tokens apart: keep only cuts after the last image token
                last = max((i for i, t in enumerate(ids) if t == image[1]), default=-1)
                if overlong == "drop" or last >= seq_len - 1 or not any(mask[1:seq_len]):
                    stats["dropped"] += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                stats["truncated"] += 1
            source: torch.Tensor | Path | None = None
            if row.get("image") is not None:
                source = pixels if pixels is not None else image_path(f, n, folder or Path(), row["image"],
                                                                      image_folder)
                stats["images"] += 1
            self.samples.append((torch.tensor(ids), torch.tensor(mask)))
            self.images.append(source)
        if not self.samples:
            raise ZooError(f"no usable LLaVA samples in {data}: {describe_stats(stats)}")
        self.items = first_fit_decreasing([len(ids) for ids, _ in self.samples], seq_len)
        self.loss_tokens = [sum(int(self.samples[j][1][1:].sum()) for j in b) for b in self.items]
        h = hashlib.sha256()
        for (ids_T, mask_T), src in zip(self.samples, self.images, strict=True):
            h.update(ids_T.numpy().tobytes() + mask_T.numpy().tobytes() + str(src if not isinstance(src, torch.Tensor)
                                                                              else float(src.sum())).encode())
        self.fingerprint = f"llava:{seq_len}:{h.hexdigest()[:16]}"
        self.stats = {**stats, "used": len(self.samples), "packs": len(self.items)}

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        images: list[torch.Tensor | None] = []
        for j in self.items[i]:
            src = self.images[j]
            images.append(load_image(src, self.vision) if isinstance(src, Path) else src)
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs], images=images)
