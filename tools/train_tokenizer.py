"""How recipes/assets/ was made: the bundled corpus, the bundled chat set, and the 2048-token BPE tokenizer.

    python tools/train_tokenizer.py            # rewrite all three into recipes/assets/
    python tools/train_tokenizer.py --check    # retrain in memory and say whether the shipped tokenizer matches

corpus.jsonl: the docstrings of a fixed list of Python standard-library modules, one module per document,
taken from the interpreter running this script (Python 3.11.7 for the shipped file). Python's documentation
strings are under the PSF License Agreement, which allows redistributing derived works with the license notice;
assets/PSF-LICENSE.txt carries it.
chat.jsonl: small conversations generated below from fixed templates and a seeded RNG (arithmetic, spelling,
word lists, sorting, a few definitions) — all text written for this project.
tokenizer.json: byte-level BPE trained on corpus.jsonl + chat.jsonl with the `tokenizers` library, exactly 2048
tokens (the vocabulary of the `debug` preset) including the special tokens below; tokenizer_config.json names
them and carries the ChatML chat template (InternLM2's) that recipes.sft uses for the bundled model.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import shutil
import sys
import sysconfig
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "recipes" / "assets"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")
MODULES = """
abc argparse ast asyncio.events asyncio.tasks base64 bisect calendar collections contextlib copy csv dataclasses
datetime decimal difflib dis email.message enum fnmatch fractions ftplib functools gettext glob gzip hashlib heapq
hmac html.parser http.client http.cookies imaplib inspect io ipaddress itertools json json.decoder locale logging
mailbox mimetypes multiprocessing.pool numbers operator optparse os pathlib pdb pickle pickletools platform
poplib pprint pydoc queue random re secrets selectors shelve shlex shutil smtplib socket socketserver sqlite3
statistics string struct subprocess tarfile tempfile textwrap threading timeit tokenize traceback turtle typing
unittest.case unittest.mock urllib.parse urllib.request uuid warnings weakref xml.dom.minidom xml.etree.ElementTree
zipfile zipimport
""".split()


def _clean(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    return re.sub(r"\n{3,}", "\n\n", doc).strip()


def module_text(name: str) -> str:
    """The module docstring followed by its public classes' and functions' docstrings, in definition order."""
    mod = importlib.import_module(name)
    parts = [_clean(mod.__doc__)] if mod.__doc__ else []
    for attr, obj in vars(mod).items():
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(f"{attr}: {_clean(doc)}")
            if inspect.isclass(obj):
                for m_name, m in vars(obj).items():
                    if not m_name.startswith("_") and inspect.isfunction(m) and m.__doc__ and len(m.__doc__) > 80:
                        parts.append(f"{attr}.{m_name}: {_clean(m.__doc__)}")
    return "\n\n".join(parts)


def make_corpus(max_bytes: int = 800_000) -> list[str]:
    docs, total = [], 0
    for name in MODULES:
        text = module_text(name)
        if len(text) < 500:
            continue
        text = text[: max(0, min(len(text), max_bytes - total, 40_000))]
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
WORDS = ("apple river window garden yellow market silver pencil rocket basket candle island monkey orange planet "
         "summer ticket violin winter zebra forest bridge castle dragon engine flower guitar hammer jacket kitten "
         "ladder mirror needle pepper rabbit saddle tunnel button cherry dollar").split()
DEFINITIONS = {
    "a list": "an ordered, mutable sequence of items, written with square brackets",
    "a tuple": "an ordered, immutable sequence of items, written with parentheses",
    "a dictionary": "a mapping from keys to values, written with curly braces",
    "a set": "an unordered collection of distinct items",
    "a function": "a named block of code that takes arguments and returns a value",
    "a loop": "a statement that repeats a block of code",
    "a module": "a file of Python code that other code can import",
    "an exception": "an object that signals an error and stops the normal flow until it is handled",
    "a string": "an immutable sequence of characters",
    "a class": "a template for objects that bundles data with the functions that act on it",
    "recursion": "a function calling itself on a smaller piece of the problem",
    "a variable": "a name that refers to a value",
}
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence.",
           "You are a friendly tutor who explains things simply."]


def _pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"How do you spell {w}?", f"{w} is spelled {'-'.join(w.upper())}."
    if kind == 3:
        w = rng.choice(WORDS)
        return f"Write the word {w} backwards.", f"Backwards, {w} is {w[::-1]}."
    if kind == 4:
        ws = rng.sample(WORDS, rng.randrange(3, 7))
        return f"Sort these words: {', '.join(ws)}.", f"In alphabetical order: {', '.join(sorted(ws))}."
    if kind == 5:
        term = rng.choice(sorted(DEFINITIONS))
        return f"In Python, what is {term}?", f"In Python, {term} is {DEFINITIONS[term]}."
    n = rng.randrange(len(NUMBER_WORDS))
    return f"Write the number {n} in words.", f"The number {n} is written {NUMBER_WORDS[n]}."


def make_chat(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            q, a = _pair(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        samples.append({"messages": messages})
    return samples


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}: the corpus is too small")
    return tok


def chat_texts(samples: list[dict]) -> list[str]:
    return ["\n".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in s["messages"]) for s in samples]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="retrain from the shipped corpus and compare")
    args = p.parse_args(argv)
    if args.check:
        docs = [json.loads(line)["text"] for line in (ASSETS / "corpus.jsonl").open()]
        chat = [json.loads(line) for line in (ASSETS / "chat.jsonl").open()]
        tok = train_tokenizer(docs + chat_texts(chat))
        same = json.loads(tok.to_str()) == json.loads((ASSETS / "tokenizer.json").read_text())
        print("shipped tokenizer matches" if same else "shipped tokenizer differs from a fresh training")
        return
    ASSETS.mkdir(parents=True, exist_ok=True)
    docs = make_corpus()
    chat = make_chat()
    with (ASSETS / "corpus.jsonl").open("w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    with (ASSETS / "chat.jsonl").open("w") as f:
        for s in chat:
            f.write(json.dumps(s) + "\n")
    tok = train_tokenizer(docs + chat_texts(chat))
    tok.save(str(ASSETS / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 2048,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    (ASSETS / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", ASSETS / "PSF-LICENSE.txt")
    print(f"{len(docs)} documents ({sum(map(len, docs))} chars), {len(chat)} chats, "
          f"python {sys.version.split()[0]} -> {ASSETS}")


if __name__ == "__main__":
    main()
