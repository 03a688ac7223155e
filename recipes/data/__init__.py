"""Training data as a deterministic sequence of packs: pack g of the run is a pure function of (data, seed, g).

That makes resuming exact (the data position is one integer) and makes the losses independent of the process
count: step s uses packs s*P .. s*P+P-1 (P = batch_tokens / seq_len), and data-parallel rank r takes its
contiguous slice of them. Each epoch visits the packs in a new seeded permutation (packs.py).

- PretrainData (text.py): JSONL {"text": ...}; documents get <s> ... </s>, are concatenated and cut into seq_len
  windows; the pieces of documents inside a window are packed as separate documents (positions restart, no
  cross-document attention or targets).
- TokenData (tokenized.py): the same packs over a dataset written by `python -m recipes.pretokenize` (token shards,
  document index, manifest), read by memory map: nothing in proportion to the corpus is read or held at start.
- SFTData (chat.py): JSONL {"messages": [{"role", "content"}, ...]}; each sample rendered with a chat template, loss
  on assistant tokens only, samples packed whole into seq_len bins by first-fit decreasing.
- LlavaData (llava.py): LLaVA-Instruct samples (or built-in synthetic images), packed whole as SFTData's.
- VLMData (vlm.py): TRL's vision-language rows or LLaVA's JSON for Qwen2.5-VL / Gemma 3, each image expanded by the
  model's expand_placeholders, packed whole with its image tokens counted.

JSONL files and lines are read and checked in jsonl.py.
"""

from recipes.data.chat import SFTData
from recipes.data.jsonl import check_line, list_files, read_jsonl
from recipes.data.llava import LlavaData
from recipes.data.packs import PackedData, first_fit_decreasing
from recipes.data.text import PretrainData, pretrain_data, text_of, wrap
from recipes.data.tokenized import (
    DOCUMENTS,
    FORMAT,
    MANIFEST,
    VERSION,
    TokenData,
    is_dataset,
    read_manifest,
    token_dtype,
    tokenizer_hash,
)

__all__ = ["DOCUMENTS", "FORMAT", "MANIFEST", "VERSION", "LlavaData", "PackedData", "PretrainData", "SFTData",
           "TokenData", "check_line", "first_fit_decreasing", "is_dataset", "list_files", "pretrain_data",
           "read_jsonl", "read_manifest", "text_of", "token_dtype", "tokenizer_hash", "wrap"]
