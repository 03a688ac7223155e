"""Hostile input, round three: counts in a Hugging Face config.json that would allocate before any other check (a
billion layers without `layer_types`, 2^40 experts, each a per-layer or per-expert tuple) or divide by zero (0 heads)
are refused in one line naming the file and the field, at once, in every family that builds such tuples, text
configs inside a multimodal config included."""

import json
import time
from pathlib import Path

import pytest

import zoo
from zoo.io.config import read_config
from zoo.models import FAMILIES
from zoo.models.family import MAX_COUNT
from zoo.models.presets import PRESETS

CASES = [  # (family, multimodal model_type or None, key, value)
    ("qwen3_moe", None, "num_experts", 10**9),
    ("qwen3_moe", None, "num_experts", 2**40),
    ("qwen3_5", None, "num_hidden_layers", 10**9),
    ("qwen3_5", None, "num_hidden_layers", 10**7),
    ("qwen3_5", None, "num_key_value_heads", 0),
    ("qwen3_5", "qwen3_5", "num_hidden_layers", 10**9),
    ("qwen3_5_moe", None, "num_experts", 10**9),
    ("qwen3_5_moe", None, "num_hidden_layers", 10**9),
    ("qwen3_5_moe", "qwen3_5_moe", "num_experts", 2**40),
    ("gemma3", None, "num_hidden_layers", 10**9),
    ("gemma3", None, "num_key_value_heads", 0),
    ("gemma3", "gemma3", "num_hidden_layers", 10**9),
    ("gemma3", "gemma3", "num_key_value_heads", 0),
    ("olmo2", None, "num_attention_heads", 0),
]


def _hf_config(family: str) -> dict:
    preset = next(p for p in PRESETS.values() if p.family == family)
    return FAMILIES[family].config_to_hf(preset.config)


def _write(tmp_path: Path, family: str, multimodal: str | None, key: str, value: int) -> Path:
    hf = _hf_config(family)
    hf.pop("layer_types", None)  # the count alone decides how long the per-layer tuple is
    hf[key] = value
    if multimodal is not None:
        hf = {"model_type": multimodal, "text_config": hf}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("family, multimodal, key, value", CASES,
                         ids=[f"{c[0]}-{c[1] or 'text'}-{c[2]}-{c[3]}" for c in CASES])
def test_a_count_that_would_allocate_or_divide_by_zero_is_refused_at_once(tmp_path, family, multimodal, key, value):
    ckpt = _write(tmp_path, family, multimodal, key, value)
    start = time.perf_counter()
    with pytest.raises(zoo.ZooError, match=rf"config\.json: .*{key} must be an integer in 1\.\.{MAX_COUNT}, "
                                           rf"got {value}") as e:
        read_config(ckpt)
    assert time.perf_counter() - start < 1.0
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "olmo2"])
def test_the_published_counts_stay_inside_the_bound(tmp_path, family):
    (tmp_path / "config.json").write_text(json.dumps(_hf_config(family)))
    read_config(tmp_path)


@pytest.mark.parametrize("message, got", [("hi", "got str"), ({"content": "hi"}, r"got keys \['content'\]"),
                                          ({"role": 1, "content": "hi"}, r"got keys \['content', 'role'\]")])
def test_render_refuses_a_message_without_a_role_in_one_line(message, got):
    from zoo.io.chat import render
    with pytest.raises(zoo.ZooError, match=rf"message 1 must be an object with a string role, {got}"):
        render([{"role": "user", "content": "hello"}, message], "chatml", None)  # type: ignore[arg-type]
