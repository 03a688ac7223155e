"""Training data as a deterministic sequence of packs: pack g of the run is a pure function of (data, seed, g).

That makes resuming exact (the data position is one integer) and makes the losses independent of the process
count: step s uses packs s*P .. s*P+P-1 (P = batch_tokens / seq_len), and data-parallel rank r takes its
contiguous slice of them. Each epoch visits the packs in a new seeded permutation.

- PretrainData: JSONL {"text": ...}; documents get <s> ... </s>, are concatenated and cut into seq_len windows;
  the pieces of documents inside a window are packed as separate documents (positions restart, no cross-document
  attention or targets).
- TokenData: the same packs over a dataset written by `python -m recipes.tokenize` (token shards, document index,
  manifest), read by memory map: nothing in proportion to the corpus is read or held at start.
- SFTData: JSONL {"messages": [{"role", "content"}, ...]}; each sample rendered with a chat template, loss on
  assistant tokens only, samples packed whole into seq_len bins by first-fit decreasing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from zoo import Packed, ZooError, pack
from zoo.io.paths import inside
from zoo.io.tokenizer import Tokenizer, encode_chat

ASSETS = Path(__file__).resolve().parent / "assets"


def list_files(data: str | Path, suffixes: tuple[str, ...] = (".jsonl",)) -> list[Path]:
    """A file, or every *.jsonl under a directory (sorted, so the order is the same on every machine)."""
    p = Path(data)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        if not files:
            raise ZooError(f"no {'/'.join(suffixes)} files under {p}")
        return files
    raise ZooError(f"data {p} does not exist: expected a {'/'.join(suffixes)} file or a directory of them")


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a UTF-16 pair, not a character


def check_line(f: Path, n: int, raw: bytes) -> dict | None:
    """The JSON object on line `n` of `f` (None for a blank line); a malformed line is an error naming both."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ZooError(f"{f}:{n}:{e.start + 1}: not UTF-8 (byte {raw[e.start]:#04x}); JSONL data must be "
                       "UTF-8 text") from e
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ZooError(f"{f}:{n}:{e.colno}: malformed JSON line ({e.msg} at column {e.colno}); "
                       "each line must be one JSON object") from e
    except RecursionError as e:
        raise ZooError(f"{f}:{n}: JSON nested too deeply") from e
    if not isinstance(obj, dict):
        raise ZooError(f"{f}:{n}: expected a JSON object per line, got {type(obj).__name__}")
    if SURROGATE_ESCAPE.search(line):
        try:  # an escaped lone surrogate decodes to a str no tokenizer can encode
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ZooError(f"{f}:{n}: a lone surrogate escape (\\u{ord(e.object[e.start]):04x}) is "
                           "not text") from e
    return obj


def read_jsonl(files: list[Path]) -> Iterator[tuple[Path, int, dict]]:
    """(file, line number, object) for every non-blank line; a malformed line is an error naming both."""
    for f in files:
        with f.open("rb") as fh:
            for n, raw in enumerate(fh, 1):
                obj = check_line(f, n, raw)
                if obj is not None:
                    yield f, n, obj


def text_of(f: Path, n: int, obj: dict) -> str:
    """The document of a pretraining line: {"text": "..."}."""
    text = obj.get("text")
    if not isinstance(text, str):
        raise ZooError(f"{f}:{n}: expected {{\"text\": \"...\"}}, got keys {sorted(obj)}")
    return text


def wrap(tok: Tokenizer, ids: list[int]) -> list[int]:
    """A pretraining document as it enters the stream: <s> ids </s> (each when the tokenizer has it)."""
    return ([tok.bos_id] if tok.bos_id is not None else []) + ids + ([tok.eos_id] if tok.eos_id is not None else [])


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass
class PackedData:
    """Packs by global index; subclasses fill `items` (what pack i holds) and implement `_build`."""

    seed: int
    items: list = field(default_factory=list)
    loss_tokens: list[int] = field(default_factory=list)  # targets in each pack
    fingerprint: str = ""
    stats: dict = field(default_factory=dict)
    _perms: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.items)

    def index(self, g: int) -> int:
        """Which pack the run's g-th pack is: epoch g // len, in that epoch's permutation."""
        epoch, i = divmod(g, len(self))
        if epoch not in self._perms:
            self._perms = {epoch: _permutation(len(self), self.seed, epoch)}
        return int(self._perms[epoch][i])

    def pack(self, g: int) -> Packed:
        return self._build(self.index(g))

    def num_loss_tokens(self, g: int) -> int:
        return self._loss_tokens(self.index(g))

    def _loss_tokens(self, i: int) -> int:
        return self.loss_tokens[i]

    def in_order(self, i: int) -> Packed:
        """Pack i itself, not the run's i-th (evaluation reads every pack once, in order)."""
        return self._build(i)

    def _build(self, i: int) -> Packed:
        raise NotImplementedError


class PretrainData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int):
        super().__init__(seed)
        files = list_files(data or ASSETS / "corpus.jsonl")
        texts = [text_of(f, n, obj) for f, n, obj in read_jsonl(files)]
        stream, starts = [], []
        for ids in tok.encode_batch(texts):
            if not ids:  # an empty document adds nothing, not even <s> </s>
                continue
            starts.append(len(stream))
            stream += wrap(tok, ids)
        n_windows = len(stream) // seq_len
        if n_windows == 0:
            raise ZooError(f"{data or 'the corpus'} holds {len(stream)} tokens, fewer than one --seq-len "
                           f"({seq_len}); lower --seq-len or add text")
        self.stream = torch.tensor(stream[: n_windows * seq_len], dtype=torch.int32)
        self.seq_len = seq_len
        doc_starts = torch.tensor(starts + [len(stream)], dtype=torch.int64)
        # cut points of window i: its start, the document starts inside it, its end
        self.items = []
        for i in range(n_windows):
            a, b = i * seq_len, (i + 1) * seq_len
            inner = doc_starts[(doc_starts > a) & (doc_starts < b)].tolist()
            self.items.append([a, *inner, b])
        self.loss_tokens = [seq_len - (len(cuts) - 1) for cuts in self.items]
        h = hashlib.sha256(self.stream.numpy().tobytes())
        self.fingerprint = f"pretrain:{seq_len}:{h.hexdigest()[:16]}"
        self.stats = {"files": len(files), "documents": len(starts), "tokens": len(stream), "packs": n_windows}

    def _build(self, i: int) -> Packed:
        cuts = self.items[i]
        ids = self.stream[cuts[0] : cuts[-1]].long()
        return pack(list(ids.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])))


# ---- tokenized datasets (python -m recipes.tokenize) ----

FORMAT, VERSION, MANIFEST, DOCUMENTS = "zoo-tokens", 1, "manifest.json", "documents.npy"


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_hash(tok: Tokenizer) -> str:
    """What decides a dataset's tokens: the tokenizer file and the ids that wrap each document."""
    h = hashlib.sha256(tok.path.read_bytes())
    h.update(json.dumps({"bos_id": tok.bos_id, "eos_id": tok.eos_id, "vocab_size": tok.vocab_size}).encode())
    return h.hexdigest()


def is_dataset(data: str | Path | None) -> bool:
    return data is not None and Path(data).is_dir() and (Path(data) / MANIFEST).is_file()


def read_manifest(root: Path) -> dict:
    """OUT/manifest.json of a tokenized dataset, its format and version checked."""
    path = inside(root, MANIFEST, "dataset manifest")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZooError(f"{path}: not a valid manifest ({e}); re-create it with python -m recipes.tokenize") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        got = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
        raise ZooError(f"{path}: expected a {FORMAT} manifest version {VERSION}, got {got}; re-create the dataset "
                       "with python -m recipes.tokenize")
    return m


class TokenData(PackedData):
    """The packs of PretrainData over a tokenized dataset, read by memory map: start-up reads the manifest and
    stats the shards (nothing in proportion to the corpus), and a pack reads only its own window's tokens and the
    few document offsets around it. Pack i is the same window, cut at the same document starts, as PretrainData
    builds from the JSONL the dataset was made from."""

    def __init__(self, data: str | Path, tok: Tokenizer, seq_len: int, seed: int):
        super().__init__(seed)
        self.root = Path(data)
        m = read_manifest(self.root)
        want = tokenizer_hash(tok)
        if m["tokenizer"]["sha256"] != want:
            raise ZooError(f"{self.root}: tokenized with another tokenizer (manifest {m['tokenizer']['sha256'][:16]}, "
                           f"the model's {tok.path} is {want[:16]}); re-run python -m recipes.tokenize with "
                           "--tokenizer of this model")
        self.dtype = np.dtype(m["dtype"])
        self.shards = []
        for s in m["shards"]:
            path = inside(self.root, s["file"], "token shard")
            if path.stat().st_size != s["tokens"] * self.dtype.itemsize:
                raise ZooError(f"{path}: {path.stat().st_size} bytes, the manifest says {s['tokens']} {self.dtype} "
                               "tokens; the dataset is damaged: re-create it")
            self.shards.append(path)
        self.shard_starts = np.cumsum([0] + [s["tokens"] for s in m["shards"]])
        self.doc_starts = np.load(inside(self.root, DOCUMENTS, "document index"), mmap_mode="r")
        if self.doc_starts.shape != (m["documents"] + 1,) or int(self.shard_starts[-1]) != m["tokens"]:
            raise ZooError(f"{self.root}: the document index or the shards disagree with the manifest; re-create it")
        self.seq_len = seq_len
        self.n_windows = m["tokens"] // seq_len
        if self.n_windows == 0:
            raise ZooError(f"{data} holds {m['tokens']} tokens, fewer than one --seq-len ({seq_len}); lower "
                           "--seq-len or add text")
        # the manifest names every source by hash and the tokenizer: its hash identifies the tokens
        digest = hashlib.sha256(inside(self.root, MANIFEST).read_bytes()).hexdigest()
        self.fingerprint = f"pretrain:{seq_len}:{digest[:16]}"
        self.stats = {"files": len(m["sources"]), "documents": m["documents"], "tokens": m["tokens"],
                      "packs": self.n_windows, "dataset": str(self.root)}

    def __len__(self) -> int:
        return self.n_windows

    def cuts(self, i: int) -> list[int]:
        """Window i's start, the document starts strictly inside it, its end (PretrainData.items[i])."""
        a, b = i * self.seq_len, (i + 1) * self.seq_len
        lo, hi = np.searchsorted(self.doc_starts, [a, b], side="right")
        inner = [int(x) for x in self.doc_starts[lo:hi] if x < b]
        return [a, *inner, b]

    def _loss_tokens(self, i: int) -> int:
        return self.seq_len - (len(self.cuts(i)) - 1)

    def tokens(self, a: int, b: int) -> np.ndarray:
        """Stream positions a..b-1, across shard boundaries."""
        parts = []
        k = int(np.searchsorted(self.shard_starts, a, side="right")) - 1
        while a < b:
            start, end = int(self.shard_starts[k]), int(self.shard_starts[k + 1])
            take = min(b, end)
            # a map of just these tokens, copied and unmapped: a map of the whole shard would keep every page the
            # run touched resident (the kernel maps page-cache folios of up to 2 MB per fault), so the resident set
            # would grow with the corpus over a run
            window = np.memmap(self.shards[k], dtype=self.dtype, mode="r", offset=(a - start) * self.dtype.itemsize,
                               shape=(take - a,))
            parts.append(np.array(window))
            del window
            a, k = take, k + 1
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _build(self, i: int) -> Packed:
        cuts = self.cuts(i)
        ids = torch.from_numpy(self.tokens(cuts[0], cuts[-1]).astype(np.int64))
        return pack(list(ids.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)])))


def pretrain_data(data: str | None, tok: Tokenizer, seq_len: int, seed: int) -> PackedData:
    """--data as a tokenized dataset (a directory with manifest.json) or JSONL."""
    if is_dataset(data):
        return TokenData(data, tok, seq_len, seed)
    return PretrainData(data, tok, seq_len, seed)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: longest first, each into the first bin it fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}")
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def check_messages(f: Path, n: int, obj: dict) -> list[dict]:
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise ZooError(f"{f}:{n}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with string "
                       f"role and content, got {json.dumps(obj)[:120]}")
    return msgs


class SFTData(PackedData):
    def __init__(self, data: str | None, tok: Tokenizer, seq_len: int, seed: int, template: str = "auto",
                 overlong: str = "truncate"):
        super().__init__(seed)
        if overlong not in ("truncate", "drop"):
            raise ZooError(f"--overlong must be 'truncate' or 'drop', got {overlong!r}")
        files = list_files(data or ASSETS / "chat.jsonl")
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        stats = {"files": len(files), "samples": 0, "no_assistant": 0, "truncated": 0, "dropped": 0}
        for f, n, obj in read_jsonl(files):
            msgs = check_messages(f, n, obj)
            stats["samples"] += 1
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant"] += 1
                continue
            try:
                ids, mask = encode_chat(msgs, template, tok)
            except ZooError as e:
                raise ZooError(f"{f}:{n}: {e}") from e
            if len(ids) > seq_len:
                if overlong == "drop" or not any(mask[1:seq_len]):
                    stats["dropped"] += 1
                    continue
                ids, mask = ids[:seq_len], mask[:seq_len]
                stats["truncated"] += 1
            self.samples.append((torch.tensor(ids), torch.tensor(mask)))
        if not self.samples:
            raise ZooError(f"no usable chat samples in {data or 'the bundled chat set'} ({stats})")
        self.items = first_fit_decreasing([len(ids) for ids, _ in self.samples], seq_len)
        # a target is a token whose *next* token is an assistant token (zoo.pack shifts the mask)
        self.loss_tokens = [sum(int(self.samples[j][1][1:].sum()) for j in b) for b in self.items]
        h = hashlib.sha256()
        for ids, mask in self.samples:
            h.update(ids.numpy().tobytes())
            h.update(mask.numpy().tobytes())
        self.fingerprint = f"sft:{seq_len}:{h.hexdigest()[:16]}"
        stats.update(used=len(self.samples), packs=len(self.items),
                     fill=round(sum(len(s[0]) for s in self.samples) / (len(self.items) * seq_len), 3))
        self.stats = stats

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs])


# ---- LLaVA ----

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_llava(data: str) -> Iterator[tuple[Path, int, dict]]:
    """LLaVA-Instruct samples from a .json list (the published layout) or .jsonl files; (file, number, sample)."""
    for f in list_files(data, (".json", ".jsonl")):
        if f.suffix == ".jsonl":
            yield from read_jsonl([f])
            continue
        try:
            rows = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ZooError(f"{f}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(rows, list):
            raise ZooError(f"{f}: expected a JSON list of LLaVA samples, got {type(rows).__name__}")
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ZooError(f"{f}: sample {n} is a {type(row).__name__}, expected an object")
            yield f, n, row


def llava_messages(f: Path, n: int, row: dict, image_text: str = "<image>") -> list[dict]:
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


def load_image(path: Path, vision) -> torch.Tensor:
    """[3, S, S] pixels: LLaVA-1.5's pad to square, then CLIP's preprocessing (needs Pillow)."""
    from PIL import Image

    from zoo.io.image import clip_preprocess

    with Image.open(path) as im:
        return clip_preprocess(im, size=vision.image_size, pad=True)


def synthetic_shapes(n: int, vision, seed: int = 0) -> list[tuple[dict, torch.Tensor]]:
    """The built-in LLaVA set: a colored square on a colored background, and questions about its colors."""
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # zoo.io.image's
    colors = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.1, 0.2, 1.0), "yellow": (1.0, 0.9, 0.1),
              "black": (0.0, 0.0, 0.0), "white": (1.0, 1.0, 1.0)}
    names = sorted(colors)
    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor(clip_mean)[:, None, None]
    std = torch.tensor(clip_std)[:, None, None]
    out, S = [], vision.image_size
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
                 model_config, template: str = "auto", overlong: str = "drop", synthetic: int = 512):
        super().__init__(seed)
        self.vision, image = model_config.vision, ("<image>", model_config.image_token_id, model_config.image_tokens)
        if data is None:
            rows = [(Path("<synthetic>"), n, row, pixels)
                    for n, (row, pixels) in enumerate(synthetic_shapes(synthetic, self.vision, seed), 1)]
        else:
            rows = [(f, n, row, None) for f, n, row in read_llava(data)]
        folder = Path(image_folder) if image_folder else (Path(data).parent if data else None)
        self.samples, self.images = [], []
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
            source = None
            if row.get("image") is not None:
                source = pixels if pixels is not None else (folder / row["image"] if folder else Path(row["image"]))
                if not isinstance(source, torch.Tensor) and not source.is_file():
                    raise ZooError(f"{f}:{n}: image {source} not found (--image-folder is "
                                   f"{image_folder or 'not set'})")
                stats["images"] += 1
            self.samples.append((torch.tensor(ids), torch.tensor(mask)))
            self.images.append(source)
        if not self.samples:
            raise ZooError(f"no usable LLaVA samples in {data} ({stats})")
        self.items = first_fit_decreasing([len(ids) for ids, _ in self.samples], seq_len)
        self.loss_tokens = [sum(int(self.samples[j][1][1:].sum()) for j in b) for b in self.items]
        h = hashlib.sha256()
        for (ids, mask), src in zip(self.samples, self.images, strict=True):
            h.update(ids.numpy().tobytes() + mask.numpy().tobytes() + str(src if not isinstance(src, torch.Tensor)
                                                                          else float(src.sum())).encode())
        self.fingerprint = f"llava:{seq_len}:{h.hexdigest()[:16]}"
        stats.update(used=len(self.samples), packs=len(self.items))
        self.stats = stats

    def _build(self, i: int) -> Packed:
        docs = [self.samples[j] for j in self.items[i]]
        images = []
        for j in self.items[i]:
            src = self.images[j]
            if src is not None and not isinstance(src, torch.Tensor):
                src = load_image(src, self.vision)
            images.append(src)
        return pack([d[0] for d in docs], label_masks=[d[1] for d in docs], images=images)
