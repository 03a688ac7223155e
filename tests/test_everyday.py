"""Everyday use (issue 31): hostile checkpoint configs and indexes, numeric strings in YAML configs, mistyped flags,
preset names, the `hf download` hint, and the console's data sentence. Each refusal is one line naming the file (or
flag) with what was expected and what came."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import zoo
from convert.common import run_cli
from convert.hf_to_zoo import main as hf_to_zoo_main
from recipes.data.packs import describe_stats
from recipes.data.text import PretrainData
from recipes.data.tokenizer_choice import ASSETS
from recipes.engine.config import parse
from recipes.engine.processes import init_distributed
from recipes.engine.sections import ParallelSection
from recipes.pretokenize import main as tokenize_main
from recipes.pretrain import PretrainConfig
from zoo.__main__ import main as zoo_main
from zoo.errors import ZooError
from zoo.generate.cli import main as generate_main
from zoo.io.tokenizer import Tokenizer
from zoo.models.presets import PRESETS, get_preset

ROOT = Path(__file__).resolve().parents[1]

# Hugging Face config.json files of tiny models: valid as they are, each case below breaks one key
LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128)
INTERNLM2 = {**LLAMA, "model_type": "internlm2"}
OPENELM = dict(model_type="openelm", model_dim=64, num_transformer_layers=2, head_dim=16, vocab_size=128,
               num_gqa_groups=2, qkv_multipliers=[0.5, 1.0], ffn_multipliers=[0.5, 4.0], ffn_dim_divisor=16)
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2_MOE = {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
DEEP = "[" * 200_000 + "]" * 200_000  # json's C scanner recurses once per level: a RecursionError, were it not caught


def checkpoint(path: Path, config: dict | str, index: str | None = None) -> Path:
    """A Hugging Face checkpoint directory with this config.json (and index), and one placeholder tensor."""
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if index is not None:
        (path / "model.safetensors.index.json").write_text(index)
    save_file({"x": torch.zeros(1)}, path / "model.safetensors")
    return path


@pytest.mark.parametrize("config, words", [
    ({**LLAMA, "rope_scaling": [1, 2]}, "rope_scaling must be an object such as {'rope_type'"),  # was AttributeError
    ({**LLAMA, "rope_scaling": "linear"}, "or null, got 'linear'"),
    ({**LLAMA, "rope_parameters": "x"}, "rope_parameters must be an object"),
    ({**INTERNLM2, "rope_scaling": [1, 2]}, "InternLM2 rope_scaling must be {'type': 'dynamic' | 'linear', 'factor'"),
    ({**INTERNLM2, "rope_scaling": {"type": "linear"}}, "factor is a finite number above 0, got {'type': 'linear'"),
    ({**OPENELM, "num_gqa_groups": 0}, "OpenELM num_gqa_groups must be a positive integer, got 0"),  # ZeroDivision
    ({**OPENELM, "ffn_dim_divisor": 0}, "OpenELM ffn_dim_divisor must be a positive integer, got 0"),
    ({**OPENELM, "head_dim": 0}, "OpenELM head_dim must be a positive integer, got 0"),
    ({**OPENELM, "head_dim": 1e308}, "OpenELM head_dim must be a positive integer, got 1e+308"),  # was OverflowError
    ({**OPENELM, "ffn_multipliers": 1e308}, "OpenELM ffn_multipliers must be finite numbers above 0, got [1e+308]"),
    ({**OPENELM, "qkv_multipliers": [1e308, 1.0]}, "qkv_multipliers must be finite numbers above 0, got [1e+308, 1.0]"),
    ({**QWEN3_MOE, "num_experts": "4"}, "num_experts must be an integer, got '4'"),
    ({**QWEN3_MOE, "num_experts_per_tok": 0}, "num_experts_per_tok must be in 1..num_experts (4), got 0"),
    ({**QWEN3_MOE, "moe_intermediate_size": 1e308}, "expert_ffn_dim must be a positive integer, got 1e+308"),
    ({**QWEN3_MOE, "mlp_only_layers": -1}, "mlp_only_layers must be a list of layer indices in 0..1, got -1"),
    ({**QWEN3_MOE, "mlp_only_layers": 0}, "mlp_only_layers must be a list of layer indices in 0..1, got 0"),
    ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ({**MIXTRAL, "num_local_experts": [4]}, "num_experts must be an integer, got [4]"),
    ({**QWEN2_MOE, "shared_expert_intermediate_size": None}, "shared_expert_ffn_dim must be a positive integer"),
    ({**QWEN2_MOE, "mlp_only_layers": True}, "mlp_only_layers must be a list of layer indices in 0..1, got True"),
])
def test_a_hostile_config_is_one_line_naming_config_json(tmp_path, capsys, config, words):
    ckpt = checkpoint(tmp_path / "ckpt", config)
    with pytest.raises(ZooError) as e:
        zoo.load(ckpt, device="meta")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{ckpt / 'config.json'}: ") and words in message, message
    assert run_cli(hf_to_zoo_main, [str(ckpt), str(tmp_path / "out")]) == 2  # the converter: the same line, exit 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("name, index, config", [
    ("model.safetensors.index.json", '{"weight_map": ' + DEEP + "}", LLAMA),
    ("model.safetensors.index.json", DEEP, LLAMA),
    ("config.json", None, '{"model_type": ' + DEEP + "}"),
])
def test_json_nested_200000_deep_is_one_line(tmp_path, capsys, name, index, config):
    ckpt = checkpoint(tmp_path / "ckpt", config, index)
    with pytest.raises(ZooError, match=r"not valid JSON \(RecursionError") as e:
        zoo.load(ckpt, device="meta")
    assert str(e.value).startswith(f"{ckpt / name}: ")
    assert run_cli(hf_to_zoo_main, [str(ckpt), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {e.value}\n"


def test_an_index_without_a_weight_map_says_what_came(tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", LLAMA, '{"weights": {}}')
    with pytest.raises(ZooError, match=r"index\.json: expected a 'weight_map' object mapping tensor names to shard "
                                       r"file names, got none$"):
        zoo.load(ckpt, device="meta")


# ---- B: numeric strings in config files ----


def test_yaml_numbers_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `5e-3` as a string; TOML and JSON have no such case. A numeric option takes the number
    a string spells; anything else is still refused in one line."""
    path = tmp_path / "c.yaml"
    path.write_text("lr: 5e-3\nsteps: '7'\nweight_decay: 1E-2\n")
    cfg = parse(PretrainConfig, ["--config", str(path)])
    assert (cfg.optim.lr, cfg.run.steps, cfg.optim.weight_decay) == (0.005, 7, 0.01)
    assert isinstance(cfg.run.steps, int)
    for text, message in [("lr: abc\n", "option lr must be a number, got 'abc'"),
                          ("steps: 1e3\n", "option steps must be an integer, got 1000.0"),
                          ("lr: .nan\n", "--lr must be a finite number above 0, or 0 to choose by what is trained, "
                                         "got nan"),
                          ("lr: nan\n", "option lr must be a number, got 'nan'"),
                          ("seq_len: 64.5\n", "option seq_len must be an integer, got 64.5")]:
        path.write_text(text)
        with pytest.raises(ZooError) as e:
            parse(PretrainConfig, ["--config", str(path)])
        assert str(e.value).endswith(message) and "\n" not in str(e.value), str(e.value)


# ---- C: mistyped flags ----


def test_a_mistyped_flag_is_one_line_with_the_closest_in_every_cli(tmp_path, capsys):
    # --step is no abbreviation of --steps any more: it is refused, and --steps still works
    with pytest.raises(ZooError, match=r"^unknown flag --step; did you mean --steps\?$"):
        parse(PretrainConfig, ["--step", "3"])
    with pytest.raises(ZooError, match=r"^unknown flag --conf; did you mean --config\?$"):
        parse(PretrainConfig, ["--conf", "c.toml"])  # the --config pre-parse takes no abbreviation either
    assert parse(PretrainConfig, ["--steps", "3"]).run.steps == 3
    with pytest.raises(ZooError, match=r"^unknown flag --qqqqqqq \(see --help\)$"):
        parse(PretrainConfig, ["--qqqqqqq"])
    # a typo of a required flag is named as the typo, not as the required flag missing
    with pytest.raises(ZooError, match=r"^unknown flag --tokeniser; did you mean --tokenizer\?$"):
        tokenize_main([str(tmp_path / "a.jsonl"), str(tmp_path / "ds"), "--tokeniser", str(ASSETS)])
    assert run_cli(hf_to_zoo_main, ["a", "b", "--forse"]) == 2
    assert capsys.readouterr().err == "error: unknown flag --forse; did you mean --force?\n"
    assert generate_main(["ckpt", "--promt", "hi"]) == 2
    assert capsys.readouterr().err == "error: unknown flag --promt; did you mean --prompt?\n"
    assert zoo_main(["preset"]) == 2
    assert "got preset; did you mean presets?" in capsys.readouterr().err
    # as a user runs it: exit code 2 and one line on stderr, not the usage
    run = subprocess.run([sys.executable, "-m", "recipes.sft", "--lora-rnak", "8"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert (run.returncode, run.stderr) == (2, "error: unknown flag --lora-rnak; did you mean --lora-rank?\n")


# ---- D: preset names ----


def test_preset_names_are_case_insensitive_and_unknown_ones_list_the_closest_few():
    assert get_preset("Qwen3-0.6B") is get_preset("qwen3-0.6b")
    assert zoo.load("Qwen3-0.6B", device="meta").config == get_preset("qwen3-0.6b").config
    with pytest.raises(ZooError) as e:
        get_preset("qwen3-0.6")
    message = str(e.value)
    assert f"`python -m zoo presets` lists all {len(PRESETS)}" in message
    listed = message.split("closest first: ")[1].split(", ")
    assert listed[0] == "qwen3-0.6b" and len(listed) == 5


# ---- E: the download hint ----


def test_the_download_hint_is_hf_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache, not the user's
    with pytest.raises(ZooError, match=r"run `hf download meta-llama/Llama-3\.1-8B` \(HF_HUB_CACHE / HF_HOME"):
        zoo.load("meta-llama/Llama-3.1-8B", device="meta")
    stale = subprocess.run(["git", "grep", "-l", "huggingface-cli", "--", "README.md", "zoo", "recipes", "convert"],
                           cwd=ROOT, capture_output=True, text=True)
    assert stale.stdout == "", stale.stdout  # huggingface_hub 1.x has no huggingface-cli


# ---- F: console sentences ----


def test_data_stats_and_the_process_count_read_as_sentences(monkeypatch):
    data = PretrainData(None, Tokenizer(ASSETS), 64, 0)
    s = data.stats
    assert data.describe() == f"1 file, {s['documents']:,} documents, {s['tokens']:,} tokens, {s['packs']:,} packs"
    assert describe_stats({"files": 2, "samples": 20, "no_assistant": 1, "truncated": 0, "dropped": 3, "used": 16,
                           "packs": 5, "fill": 0.931}) == \
        ("2 files, 20 samples, 1 without an assistant turn (skipped), 3 longer than --seq-len (dropped), 16 used, "
         "5 packs, 93% full")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ZooError, match=r"^--dp 2 x --sp 1 = 2 processes, but 1 was started; launch with torchrun"):
        init_distributed(ParallelSection(dp=2))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ZooError, match=r"= 2 processes, but 3 were started;"):
        init_distributed(ParallelSection(dp=2))


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    """zoo sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (spinning teams of two busy processes starve each
    other: 2-thread training fell ~50x beside a second one); a value the user set is kept."""
    import os
    import subprocess
    import sys

    code = "import recipes, os, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    # both at once: each is an interpreter importing torch on one core
    procs = [subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for e in (env, {**env, "OMP_WAIT_POLICY": "ACTIVE"})]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert outs[0][0].split()[-1] == "PASSIVE"
    assert outs[1][0].split()[-1] == "ACTIVE"
