"""Hostile input, round three: counts in a Hugging Face config.json that would allocate before any other check (a
billion layers without `layer_types`, 2^40 experts, each a per-layer or per-expert tuple) or divide by zero (0 heads)
are refused in one line naming the file and the field, at once, in every family that builds such tuples, text
configs inside a multimodal config included."""

import json
import re
import time
from pathlib import Path

import pytest
import torch

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


# --tools and --chat-template-kwargs, and an SFT sample's tools and switches: a file that never ends or is far larger
# than any tool list, JSON nested 10,000 deep, an integer of 5,000 digits, a switch that render() takes itself


def _generate_refuses(tmp_path, capsys, flags: list[str], match: str) -> None:
    import io
    import signal

    from zoo.generate.cli import main

    def hung(*_):
        raise TimeoutError("zoo.generate hung on its input")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert main([str(tmp_path), "--chat", *flags], stdin=io.StringIO("")) == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(match, err[0]), err[0]


def test_generate_tools_from_a_fifo_a_device_or_a_large_file_is_refused_unread(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "fifo")  # opening it for reading would wait for a writer forever
    _generate_refuses(tmp_path, capsys, ["--tools", str(tmp_path / "fifo")], r"--tools .*fifo: expected a regular "
                                                                            r"file, got a FIFO")
    _generate_refuses(tmp_path, capsys, ["--tools", "/dev/zero"], r"--tools /dev/zero: expected a regular file, got "
                                                                  r"a character device")
    _generate_refuses(tmp_path, capsys, ["--tools", str(tmp_path)], r"expected a regular file, got a directory")
    (tmp_path / "big.json").write_text("[" + ", ".join(['{"name": "f"}'] * 800_000) + "]")  # ~10 MB
    _generate_refuses(tmp_path, capsys, ["--tools", str(tmp_path / "big.json")],
                      r"--tools .*big\.json: expected a file of at most 1,048,576 bytes, got 1\d,\d{3},\d{3}")


HOSTILE_JSON = [("deep", "[" * 10_000 + "]" * 10_000, r"expected JSON nested at most 100 deep, got 1000[01] levels"),
                ("digits", "[" + "9" * 5000 + "]", r"expected integers of at most 4300 digits, got a longer one")]


@pytest.mark.parametrize("name, text, match", HOSTILE_JSON, ids=[c[0] for c in HOSTILE_JSON])
def test_generate_tools_and_switches_nested_deep_or_with_a_long_integer_are_refused(tmp_path, capsys, name, text,
                                                                                     match):
    (tmp_path / "tools.json").write_text(text)
    _generate_refuses(tmp_path, capsys, ["--tools", str(tmp_path / "tools.json")], rf"--tools .*tools\.json: {match}")
    switches = '{"x": ' + text + "}"
    _generate_refuses(tmp_path, capsys, ["--chat-template-kwargs", switches], rf"--chat-template-kwargs: {match}")


@pytest.mark.parametrize("name, text, match", HOSTILE_JSON, ids=[c[0] for c in HOSTILE_JSON])
def test_sft_samples_and_switches_nested_deep_or_with_a_long_integer_are_refused(tmp_path, name, text, match):
    from recipes.data.chat import check_template_input
    from recipes.data.jsonl import read_jsonl
    from recipes.engine.config import check
    from recipes.sft import SFTConfig

    (tmp_path / "x.jsonl").write_text('{"messages": [], "extra": ' + text + "}\n")
    with pytest.raises(zoo.ZooError, match=rf"x\.jsonl:1: {match}"):
        list(read_jsonl([tmp_path / "x.jsonl"]))
    with pytest.raises(zoo.ZooError, match=rf"x\.jsonl:1: \"tools\": {match}"):
        check_template_input(tmp_path / "x.jsonl", 1, {"tools": text}, {})
    cfg = SFTConfig()
    cfg.data.chat_template_kwargs = '{"x": ' + text + "}"
    with pytest.raises(zoo.ZooError, match=rf"--chat-template-kwargs: {match}"):
        check(cfg)


def test_a_switch_render_takes_itself_is_refused_naming_it(tmp_path, capsys):
    from recipes.data.chat import check_template_input
    from recipes.engine.config import check
    from recipes.sft import SFTConfig

    for key in ("messages", "tok", "template", "add_generation_prompt"):
        switches = json.dumps({key: []})
        _generate_refuses(tmp_path, capsys, ["--chat-template-kwargs", switches],
                          rf"--chat-template-kwargs: expected template switches .*, got '{key}', which zoo sets")
        with pytest.raises(zoo.ZooError, match=rf"x\.jsonl:3: \"chat_template_kwargs\": .*got '{key}'"):
            check_template_input(Path("x.jsonl"), 3, {"chat_template_kwargs": {key: []}}, {})
        cfg = SFTConfig()
        cfg.data.chat_template_kwargs = switches
        with pytest.raises(zoo.ZooError, match=rf"--chat-template-kwargs: .*got '{key}'"):
            check(cfg)


# recipes' configs built in Python: a misspelt option assigned, None or a dict where a value or a section belongs, a
# config of another recipe


def test_a_misspelt_config_attribute_is_refused_and_real_fields_still_set():
    import copy
    import dataclasses

    from recipes.dpo import DPOConfig
    from recipes.sft import SFTConfig

    cfg = SFTConfig()
    with pytest.raises(zoo.ZooError, match=r"OptimSection has no field 'learning_rate' \(its fields: lr, "):
        cfg.optim.learning_rate = 1e-4
    with pytest.raises(zoo.ZooError, match=r"SFTConfig has no field 'optimizer' \(did you mean optim\?\)"):
        cfg.optimizer = cfg.optim
    with pytest.raises(zoo.ZooError, match=r"PreferenceSection has no field 'bta'"):
        DPOConfig().pref.bta = 0.5
    cfg.optim.lr, cfg.run.steps = 1e-4, 7  # the fields themselves, through deepcopy and replace
    assert copy.deepcopy(cfg).optim.lr == 1e-4 and dataclasses.replace(cfg.run, seed=3).steps == 7
    assert "learning_rate" not in vars(cfg.optim)


def test_none_a_dict_or_another_section_in_a_recipe_config_is_refused_in_one_line():
    from recipes.engine.config import check
    from recipes.engine.sections import LogSection, ModelSection, RunSection
    from recipes.sft import SFTConfig

    with pytest.raises(zoo.ZooError, match=r"^--steps must be an integer, got None$"):
        check(SFTConfig(run=RunSection(steps=None)))
    check(SFTConfig(model=ModelSection(tokenizer=None)))  # `str | None`: None is its default
    cfg = SFTConfig()
    cfg.optim = {"lr": 1e-4}
    with pytest.raises(zoo.ZooError, match=r"^SFTConfig\.optim must be a section of class OptimSection, got dict$"):
        check(cfg)
    cfg = SFTConfig()
    cfg.run = LogSection()
    with pytest.raises(zoo.ZooError, match=r"^SFTConfig\.run must be a section of class RunSection, got LogSection$"):
        check(cfg)


def test_a_recipe_run_given_another_recipes_config_is_refused_naming_the_class():
    import recipes.dpo
    import recipes.pretrain
    import recipes.sft
    from recipes.dpo import DPOConfig
    from recipes.sft import SFTConfig

    with pytest.raises(zoo.ZooError, match=r"^run\(\) expects its recipe's config class SFTConfig, got DPOConfig$"):
        recipes.sft.run(DPOConfig())
    with pytest.raises(zoo.ZooError, match=r"^run\(\) expects its recipe's config class PretrainConfig, got "
                                           r"SFTConfig$"):
        recipes.pretrain.run(SFTConfig())
    with pytest.raises(zoo.ZooError, match=r"^run\(\) expects its recipe's config class DPOConfig, got SFTConfig$"):
        recipes.dpo.run(SFTConfig())


# silent wrong results: a checkpoint's balancing weight, an expert's dtype, a DPO reference table read back


@pytest.mark.parametrize("coef", [-1.0, float("nan"), float("inf")])  # a string: read_config refuses it
def test_a_checkpoints_bad_router_aux_loss_coef_is_refused_under_auto(tmp_path, coef):
    from recipes.engine.moe import Balance
    from zoo.models.decoder import Decoder
    from zoo.models.mixtral import MixtralConfig

    config = MixtralConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, n_experts=2, top_k=1,
                           expert_ffn_dim=8, max_seq_len=64)
    hf = FAMILIES["mixtral"].config_to_hf(config)
    hf["router_aux_loss_coef"] = coef
    (tmp_path / "config.json").write_text(json.dumps(hf))  # NaN and Infinity as Python's json writes them
    model = Decoder(read_config(tmp_path)[1])
    with pytest.raises(zoo.ZooError, match=r"^--aux-loss-coef auto: expected the checkpoint's router_aux_loss_coef "
                                           r"\(config\.json\) to be a finite number at least 0, got "):
        Balance.for_model(model, "auto", "batch", 0.0)
    balance = Balance.for_model(model, "0.01", "batch", 0.0)  # a coefficient of its own: the checkpoint's unread
    assert balance is not None and balance.aux_loss_coef == 0.01


def test_an_expert_stored_as_int32_is_refused_not_promoted(tmp_path, capsys):
    import transformers
    from safetensors.torch import load_file, save_file

    from convert import hf_to_zoo
    from convert.common import run_cli

    src = tmp_path / "mixtral"  # transformers' layout: each expert's weights a tensor of their own, stacked on load
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=64)
    transformers.MixtralForCausalLM(config).save_pretrained(src)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in tensors if ".experts.1." in n)
    tensors[name] = tensors[name].view(torch.int32) if tensors[name].dtype == torch.float32 else tensors[name].int()
    save_file(tensors, shard, metadata={"format": "pt"})
    match = rf"tensor {re.escape(name)} has dtype torch\.int32; a model weight must be a floating point tensor"
    with pytest.raises(zoo.ZooError, match=match):
        zoo.load(src)
    capsys.readouterr()
    assert run_cli(hf_to_zoo.main, [str(src), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, table, match", [
    ("nan", torch.tensor([[-1.0, float("nan")], [-2.0, -3.0], [-1.0, -1.0]]),
     r"expected finite log-probs in ref_logps, got 1 NaN or infinite; remove the file"),
    ("short", torch.zeros(2, 2), r"expected ref_logps as \[3, 2\] floats .*, got \[2, 2\] torch\.float32; remove"),
    ("int", torch.zeros(3, 2, dtype=torch.int32), r"expected ref_logps as \[3, 2\] floats .*, got \[3, 2\] "
                                                  r"torch\.int32"),
], ids=["nan", "short", "int"])
def test_a_precomputed_dpo_reference_table_read_back_wrong_is_refused(tmp_path, name, table, match):
    from recipes.dpo.reference import read_tables, write_tables

    path = tmp_path / "ref_logps.safetensors"
    shapes = {"ref_logps": (3, 2)}
    write_tables(path, {"ref_logps": table}, key="k")
    with pytest.raises(zoo.ZooError, match=rf"^{re.escape(str(path))}: {match}"):
        read_tables(path, "k", shapes)
    assert read_tables(path, "another key", shapes) is None  # computed for other pairs: computed again
    write_tables(path, {"ref_logps": -torch.ones(3, 2)}, key="k")
    assert read_tables(path, "k", shapes)["ref_logps"].shape == (3, 2)
    with pytest.raises(zoo.ZooError, match=r"expected eval_ref_logps as \[5, 2\] floats .*, got none"):
        read_tables(path, "k", shapes | {"eval_ref_logps": (5, 2)})


# a full disk while a checkpoint or a conversion is written


def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint_and_leaves_no_tmp(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    from recipes import pretrain
    from recipes.engine.checkpoint import complete
    from recipes.engine.sections import CheckpointSection, DataSection, LogSection, ParallelSection, RunSection

    out = tmp_path / "run"
    cfg = pretrain.PretrainConfig(run=RunSection(out=str(out), steps=2), data=DataSection(seq_len=64, batch_tokens=64),
                                  parallel=ParallelSection(device="cpu"), log=LogSection(progress=False),
                                  checkpoint=CheckpointSection(save_every=1))
    real, calls = HuggingFaceStorageWriter.write_data, []

    def write_data(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(out / "shard"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", write_data)
    with pytest.raises(zoo.ZooError, match=r"step_00000002: checkpoint not written \(No space left on device: .*"
                                           r"shard\); the last complete one, step_00000001, is kept$") as e:
        pretrain.run(cfg)
    assert "\n" not in str(e.value)
    assert [p.name for p in complete(out)] == ["step_00000001"]
    assert not list((out / "checkpoints").glob(".*tmp*"))


def test_a_full_disk_while_converting_is_one_line_and_the_destination_untouched(tmp_path, monkeypatch, capsys):
    import shutil

    from conftest import fixture_dir
    from safetensors import SafetensorError

    import zoo.io.safetensors
    from convert import hf_to_zoo
    from convert.common import run_cli

    src, dst = tmp_path / "llama", tmp_path / "out"
    shutil.copytree(fixture_dir("llama"), src, ignore=shutil.ignore_patterns("golden.safetensors", "README.md"))
    assert run_cli(hf_to_zoo.main, [str(src), str(dst), "--quiet"]) == 0  # an earlier conversion, to be kept
    before = {p.name: p.read_bytes() for p in dst.iterdir()}

    def full(*_, **__):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(zoo.io.safetensors, "save_file", full)
    capsys.readouterr()
    assert run_cli(hf_to_zoo.main, [str(src), str(dst), "--quiet", "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.match(r"error: No space left on device \(.*shard-00000\.tmp\); nothing "
                                                   r"was written$", err), err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]  # no temporary directory left


def test_a_full_disk_while_writing_the_dpo_reference_table_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    import zoo.io.safetensors
    from recipes.dpo.reference import write_tables

    def full(*_, **__):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(zoo.io.safetensors, "save_file", full)
    with pytest.raises(zoo.ZooError, match=r"ref_logps\.safetensors: reference log-probs not written \(No space left "
                                           r"on device\); --precompute-ref computes them again on --resume$"):
        write_tables(tmp_path / "ref_logps.safetensors", {"ref_logps": torch.zeros(3, 2)}, key="k")
    assert list(tmp_path.iterdir()) == []
