"""A tiny character-level tokenizer (the `tokenizers` library's BPE without merges) that both transformers and zoo
read, with special tokens at the ids a tiny checkpoint's config names: what the vision-language tests tokenize
prompts with, so that the processor's ids and zoo's can be compared."""

from __future__ import annotations

import json
from pathlib import Path

CHARS = "\nabcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:?!'<>|_/-0123456789"


def save(path: Path, specials: dict[str, int], vocab_size: int, chat_template: str | None = None,
         config: dict | None = None) -> Path:
    """tokenizer.json and tokenizer_config.json in `path`: every character of CHARS on the lowest ids not taken by
    `specials` (each a whole token at its id), `<unk>` on the next; `config` joins tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models

    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    vocab = {c: next(free) for c in CHARS}
    vocab["<unk>"] = next(free)
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", **(config or {})}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path
