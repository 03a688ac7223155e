"""python -m convert.zoo_to_hf SRC DST: a zoo checkpoint into the Hugging Face layout of its family.

The output loads with transformers (Llama, LLaVA) or the upstream remote code (InternLM2, OpenELM): the same
tensor names, shapes and config keys as the published checkpoints; fused weights are merged back.

It also generates as its source does. config.json and generation_config.json carry the bos/eos/pad ids of the zoo
config, or, when it names no eos, of the tokenizer in SRC: its bos, pad, and eos plus the end-of-turn token of its
chat template (without them transformers assumes bos=1, eos=2, whatever the vocabulary). Its tokenizer files are
SRC's: transformers encodes a prompt with them as zoo does (the checkpoint's special tokens).
A LLaVA whose image placeholder is no vocabulary entry (the original LLaVA's -200) gets the tokenizer's `<image>`,
added to the tokenizer when missing; when its id lies past the model's vocabulary, the embedding (and head) grow
to hold it, the new rows set to the mean of the others (the placeholder's embedding is never read: images replace
it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from convert.common import output_options, parse_args, run_cli, source, write_checkpoint
from zoo.errors import ZooError
from zoo.io.config import default_token_ids, language_config, tokenizer_in
from zoo.io.dtypes import as_dtype
from zoo.io.load import stream
from zoo.io.safetensors import DEFAULT_SHARD_BYTES
from zoo.io.tokenizer import Tokenizer
from zoo.models import Model, ModelConfig, gemma3_vision
from zoo.models.family import Combine, Plan, token_ids_to_hf
from zoo.models.gemma3_vision import Gemma3VisionConfig
from zoo.models.llava import LlavaConfig
from zoo.models.qwen2_5_vl import QwenVLConfig, image_processor_to_hf
from zoo.models.qwen3_vl import QWEN_VL_FAMILIES

IMAGE_TOKEN = "<image>"
GROWN = ("language_model.embed.weight", "language_model.lm_head.weight")  # a LLaVA's vocabulary-sized tensors


def zoo_to_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None,
              force: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False) -> Path:
    """Convert the zoo checkpoint in `src` into the Hugging Face layout of its family in `dst` (written atomically;
    a non-empty `dst` only with `force`), floating tensors cast to `dtype` (None: kept). Returns `dst`."""
    cast_to = as_dtype(dtype)
    family, config, fmt, reader = source(src, dst)
    if fmt != "zoo":
        raise ZooError(f"{src} is not a zoo checkpoint (its config.json has no 'format: zoo'); "
                       "for a Hugging Face checkpoint use convert.hf_to_zoo")
    with torch.device("meta"):
        model = cast(Model, family.build(config, "eager"))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    # check names and shapes of the zoo side first, reading headers only
    for name in shapes:
        if name in reader.file_of and list(reader.shape(name)) != list(shapes[name]):
            raise ZooError(f"{src}: shape mismatch for {name}: expected {list(shapes[name])}, "
                           f"got {list(reader.shape(name))}")
    next(stream(reader, {n: ((n,), None) for n in shapes}, None), None)  # raises on missing/unexpected names
    plan = family.plan_to_hf(config, list(shapes))
    src_dir = Path(src)
    config = default_token_ids(config, src_dir)
    if not language_config(config).eos_token_ids:
        print(f"note: neither the config nor a tokenizer in {src_dir} names an eos id; the output names none of its "
              "own (transformers then assumes bos=1, eos=2)", file=sys.stderr)
    files: dict[str, str] = {}
    if config.family == LlavaConfig.family:  # transformers embeds every id: LLaVA's placeholder must be a row
        config, plan, files = real_image_token(cast(LlavaConfig, config), plan, src_dir)
    if config.family in QWEN_VL_FAMILIES:  # its image processor's settings, as the published checkpoints hold
        vl = cast(QwenVLConfig, config)
        files["preprocessor_config.json"] = json.dumps(image_processor_to_hf(vl), indent=2) + "\n"
    if config.family == Gemma3VisionConfig.family:
        processor = gemma3_vision.image_processor_to_hf(cast(Gemma3VisionConfig, config))
        files["preprocessor_config.json"] = json.dumps(processor, indent=2) + "\n"
    out_dtype = cast_to if cast_to is not None else reader.get(next(iter(shapes))).dtype
    hf_config = family.config_to_hf(config)
    hf_config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    generation = generation_config(config, src_dir)
    if generation:
        files["generation_config.json"] = json.dumps(generation, indent=2) + "\n"
    write_checkpoint(dst, plan, reader, hf_config, tokenizer_from=src, extra_files=files, dtype=cast_to,
                     max_shard_bytes=max_shard_bytes, force=force, progress=progress)
    return Path(dst)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
    zoo_to_hf(args.src, args.dst, **output_options(args))


def generation_config(config: ModelConfig, src: Path) -> dict[str, Any]:
    """generation_config.json: SRC's (copied from a Hugging Face source), its token ids those of the config."""
    ids = token_ids_to_hf(language_config(config))
    if not ids:
        return {}
    old = src / "generation_config.json"
    try:
        generation = json.loads(old.read_text()) if old.is_file() else {}
    except json.JSONDecodeError as e:
        raise ZooError(f"{old}: not valid JSON ({e})") from e
    return {**generation, **ids}


def real_image_token(config: LlavaConfig, plan: Plan, src: Path) -> tuple[LlavaConfig, Plan, dict[str, str]]:
    """A LLaVA whose placeholder id is a row of the embedding (transformers embeds every input id): the config's
    when it is one, else the tokenizer's <image> (added when missing). Returns the config, the plan (growing the
    vocabulary when the id lies past it) and the rewritten tokenizer files."""
    vocab = config.language.vocab_size
    if 0 <= config.image_token_id < vocab:
        return config, plan, {}
    files: dict[str, str] = {}
    tok = tokenizer_in(src)
    image_id = tok.token_to_id(IMAGE_TOKEN) if tok is not None else None
    if image_id is None:
        if tok is None:
            image_id = vocab
            print(f"note: {src} has no tokenizer; the image placeholder becomes id {image_id} (add {IMAGE_TOKEN} "
                  "with that id to the tokenizer you use)", file=sys.stderr)
        else:
            image_id, files = add_special_token(tok, IMAGE_TOKEN)
    if image_id >= vocab:
        rows = image_id + 1
        plan = {name: (sources, _grow(combine, rows) if sources[0] in GROWN else combine)
                for name, (sources, combine) in plan.items()}
        config = dataclasses.replace(config, language=dataclasses.replace(config.language, vocab_size=rows))
    return dataclasses.replace(config, image_token_id=image_id), plan, files


def _grow(combine: Combine, rows: int) -> Combine:
    def grown(tensors: list[Tensor]) -> Tensor:
        t = tensors[0] if combine is None else combine(tensors)
        mean = t.float().mean(0, keepdim=True).to(t.dtype)
        return torch.cat([t, mean.expand(rows - t.shape[0], -1)])

    return grown


def add_special_token(tok: Tokenizer, token: str) -> tuple[int, dict[str, str]]:
    """`token` added to the tokenizer as a special token: (its id, {file name: new text}). tokenizer.json gets it
    among its added tokens; tokenizer_config.json in `added_tokens_decoder` (where a sentencepiece model's added
    tokens live, and where a tokenizer.json's are listed when the file has that map)."""
    config_file = tok.dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    files: dict[str, str] = {}
    added = config.get("added_tokens_decoder")
    if tok.path.name == "tokenizer.json":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_file(str(tok.path))
        hf.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        token_id = hf.token_to_id(token)
        if token_id is None:  # add_special_tokens just added it
            raise ZooError(f"could not add {token} to {tok.path}")
        new_id = token_id
        files["tokenizer.json"] = hf.to_str(pretty=True)
    else:
        new_id = max([tok.vocab_size - 1, *(int(i) for i in added or {})]) + 1
        added = added or {}
    if added is not None:
        added[str(new_id)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}
        config["added_tokens_decoder"] = added
        files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    return new_id, files


if __name__ == "__main__":
    sys.exit(run_cli(main))
