"""Config values are read as what they are, or refused: one checker (zoo.models.family.check_config) checks every
field of every family's config (and LLaVA's tower) for its declared type and range, naming the file. Before it,
`"tie_word_embeddings": "yes"` dropped the checkpoint's lm_head, `"bias": "false"` read as true, a rope factor of
0 or NaN loaded and gave NaN logits, `"eos_token_id": "12"` became the ids (1, 2), and eos ids past the vocabulary,
negative, fractional or boolean were taken (generation then never stops)."""

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import fixture_dir

import zoo

CASES = [  # (fixture, config.json key, value, what the message says)
    ("llama", "tie_word_embeddings", "yes", "tie_embeddings must be true or false, got 'yes'"),
    ("llama", "attention_bias", "false", "attention_bias must be true or false, got 'false'"),
    ("llama", "mlp_bias", 1, "mlp_bias must be true or false, got 1"),
    ("llama", "eos_token_id", "12", r"eos_token_ids must be a list of which each is an integer, got \('12',\)"),
    ("llama", "eos_token_id", 10**6, r"eos_token_ids must be token ids inside the vocabulary \(0\.\.\d+\)"),
    ("llama", "eos_token_id", -1, "eos_token_ids must be token ids inside the vocabulary"),
    ("llama", "eos_token_id", 1.5, "eos_token_ids must be a list of which each is an integer"),
    ("llama", "eos_token_id", True, "eos_token_ids must be a list of which each is an integer, got \\(True,\\)"),
    ("llama", "bos_token_id", [1], r"bos_token_id must be an integer or null, got \[1\]"),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8},
     "rope_scaling must be a scaling whose factor is a finite number above 0"),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": math.nan,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
     "rope_scaling must be a scaling whose low_freq_factor is a finite number above 0"),
    ("internlm2", "bias", "false", "attention_bias must be true or false, got 'false'"),
    ("internlm2", "rope_scaling", {"type": "dynamic", "factor": -2.0},
     "rope_scaling must be a scaling whose factor is a finite number above 0"),
    ("internlm2", "rope_scaling", {"type": "dynamic", "factor": math.nan},
     "rope_scaling must be a scaling whose factor is a finite number above 0"),
    ("openelm", "share_input_output_layers", "yes", "tie_embeddings must be true or false, got 'yes'"),
    ("openelm", "normalize_qk_projections", "no", "qk_norm must be true or false, got 'no'"),
    ("openelm", "rope_freq_constant", "10000", "rope_theta must be a finite number above 0, got '10000'"),
]


def _checkpoint(tmp_path: Path, name: str, key: str, value) -> Path:
    dst = tmp_path / name
    shutil.copytree(fixture_dir(name), dst, ignore=shutil.ignore_patterns("golden.safetensors", "README.md"),
                    copy_function=shutil.copyfile)
    (dst / "generation_config.json").unlink(missing_ok=True)  # its ids would win over config.json's
    config = json.loads((dst / "config.json").read_text())
    config.pop("rope_parameters", None) if key == "rope_scaling" else None
    config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("name, key, value, match", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]!r}"[:60] for c in CASES])
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_the_file(tmp_path, name, key, value, match):
    ckpt = _checkpoint(tmp_path, name, key, value)
    with pytest.raises(zoo.ZooError, match=match) as e:
        zoo.load(ckpt, device="meta")
    assert str(e.value).startswith(f"{ckpt / 'config.json'}: ")


def test_the_values_as_published_still_load(tmp_path):
    for name in ("llama", "internlm2", "openelm"):
        zoo.load(fixture_dir(name), device="meta")


def test_llava_tower_fields_are_checked(tmp_path):
    ckpt = tmp_path / "llava"
    shutil.copytree(fixture_dir("llava"), ckpt, ignore=shutil.ignore_patterns("golden.safetensors", "README.md"),
                    copy_function=shutil.copyfile)
    config = json.loads((ckpt / "config.json").read_text())
    config["vision_config"]["layer_norm_eps"] = "1e-5"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(zoo.ZooError, match="norm_eps must be a finite number above 0, got '1e-5'"):
        zoo.load(ckpt, device="meta")


@pytest.mark.parametrize("value, match", [
    (10**6, r"eos_token_ids must be token ids inside the vocabulary"),
    ([2, -1], r"eos_token_ids must be token ids inside the vocabulary"),
    ("12", r"eos_token_ids must be a list of which each is an integer, got \('12',\)"),
    (False, r"eos_token_ids must be a list of which each is an integer, got \(False,\)"),
])
def test_generation_config_ids_are_refused_naming_generation_config(tmp_path, value, match):
    """generation_config.json's eos ids win over config.json's (as in transformers' generate): a bad one is named
    in the file it came from, not in config.json, which holds good ones."""
    ckpt = _checkpoint(tmp_path, "llama", "eos_token_id", 2)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(zoo.ZooError, match=match) as e:
        zoo.load(ckpt, device="meta")
    assert str(e.value).startswith(f"{ckpt / 'generation_config.json'}: ")


def _every_config_class():
    from zoo.models import FAMILIES
    from zoo.models.clip import CLIPVisionConfig

    return [f.config_cls for f in FAMILIES.values()] + [CLIPVisionConfig]


@pytest.mark.parametrize("cls", _every_config_class(), ids=lambda c: c.__name__)
def test_each_config_declares_its_positive_fields_and_the_checker_holds_them(cls):
    """Each config class names the fields check_config requires above 0 (next to the fields, no list elsewhere): every
    name is a field, and each such field at 0 (or a tuple field holding a 0) is refused as its type says."""
    import copy
    import dataclasses
    import typing

    from zoo.models.family import check_config

    fields = {f.name for f in dataclasses.fields(cls)}
    assert cls.positive <= fields, cls.positive - fields
    preset = next((p.config for p in zoo.PRESETS.values() if type(p.config) is cls), None) or cls()
    check_config(preset, "x.json")  # as published: fine
    hints = typing.get_type_hints(cls)
    for name in sorted(cls.positive):
        bad = copy.copy(preset)
        value = getattr(preset, name)
        object.__setattr__(bad, name, tuple(0 for _ in value) or (0,) if isinstance(value, tuple) else 0)
        words = "a finite number above 0" if "float" in str(hints[name]) else "a positive integer"
        with pytest.raises(zoo.ZooError, match=f"x.json: {name} must be {words}, got"):
            check_config(bad, "x.json")
