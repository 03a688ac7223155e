"""python -m zoo.generate: the sampling defaults of a checkpoint's generation_config.json (used where no flag is
given, as transformers' generate uses them), and messages that name what the user typed: a flag out of range, a
Hugging Face hub id, a bad generation_config.json. Bad input is one line `error: ...` and exit code 2."""

import argparse
import json
import shutil

import pytest
import torch

import zoo
from zoo.generate import generate
from zoo.generate.cli import Decoding, decoding, main
from zoo.io.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from recipes.data.tokenizer_choice import ASSETS

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cli_messages") / "ckpt"
    zoo.save(zoo.load("debug"), path, tokenizer_from=ASSETS)
    (path / "generation_config.json").unlink()  # the bundled one's repetition_penalty: each test writes its own
    return path


def with_generation_config(ckpt, tmp_path, gen: dict):
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt, path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, **gen}))
    return path


def flags(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"temperature": None, "top_k": None, "top_p": None, "repetition_penalty": None, **kw})


def one_error(capsys, argv) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_generation_config_gives_the_sampling_defaults(ckpt, tmp_path):
    """As transformers: do_sample false or absent is greedy; true samples with the file's settings, transformers'
    temperature 1.0 and top_k 50 where it names none; a flag given wins; top_k 0 and top_p 1 filter nothing."""
    instruct = with_generation_config(ckpt, tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    assert decoding(flags(), str(instruct)) == Decoding(0.6, 50, 0.9)
    assert decoding(flags(temperature=0.0), str(instruct)) == Decoding(0.0, None, None)
    assert decoding(flags(temperature=1.2, top_k=0, top_p=1.0), str(instruct)) == Decoding(1.2, None, None)
    assert decoding(flags(top_k=5), str(instruct)) == Decoding(0.6, 5, 0.9)
    assert decoding(flags(), str(ckpt)) == Decoding(0.0, None, None)  # no generation_config.json: greedy
    (instruct / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6, "top_k": 7}))
    assert decoding(flags(), str(instruct)) == Decoding(0.0, None, None)
    assert decoding(flags(temperature=0.5), str(instruct)) == Decoding(0.5, 7, None)  # the file's top_k still a default
    (instruct / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 20, "top_p": None}))
    assert decoding(flags(), str(instruct)) == Decoding(1.0, 20, None)
    # transformers applies repetition_penalty greedy or sampling; the flag wins
    (instruct / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))
    assert decoding(flags(), str(instruct)) == Decoding(repetition_penalty=1.3)
    assert decoding(flags(repetition_penalty=1.0), str(instruct)) == Decoding()
    assert decoding(flags(temperature=0.5), str(instruct)) == Decoding(0.5, None, None, 1.3)


def test_the_cli_samples_as_generation_config_says(ckpt, tmp_path, capsys):
    path = with_generation_config(ckpt, tmp_path, {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.95})
    argv = [str(path), "--prompt", "Return the list", "--max-new-tokens", "10", "--seed", "3", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tok = Tokenizer(path)
    model = zoo.load(path, dtype=torch.float32)
    stop = tuple(dict.fromkeys([*model.eos_token_ids, *tok.stop_ids()]))
    prompt = torch.tensor(tok.encode("Return the list"))  # the bundled tokenizer's bos first
    sampled = generate(model, [prompt], max_new_tokens=10, temperature=0.7, top_k=40, top_p=0.95, seed=3,
                       stop=stop)[0].tolist()
    greedy = generate(model, [prompt], max_new_tokens=10, stop=stop)[0].tolist()
    assert sampled != greedy  # else this test could not tell sampling from greedy
    assert out == "Return the list" + tok.decode([t for t in sampled if t not in stop]) + "\n"  # prompt, continuation
    assert main([*argv, "--temperature", "0"]) == 0  # the flag wins: greedy
    assert capsys.readouterr().out == "Return the list" + tok.decode([t for t in greedy if t not in stop]) + "\n"


@pytest.mark.parametrize("gen, needle", [
    ({"do_sample": "yes"}, "do_sample must be true or false, got 'yes'"),
    ({"do_sample": True, "temperature": 0}, "temperature must be above 0 where do_sample is true, got 0"),
    ({"temperature": "0.7"}, "temperature must be a finite number >= 0, got '0.7'"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number above 0 (1: none), got 0"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty must be a finite number above 0 (1: none), got '1.2'"),
])
def test_a_bad_generation_config_is_one_line(ckpt, tmp_path, capsys, gen, needle):
    path = with_generation_config(ckpt, tmp_path, gen)
    err = one_error(capsys, [str(path), "--prompt", "hi", "--device", "cpu"])
    assert f"{path / 'generation_config.json'}: {needle}" in err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature -1.0: expected 0 (greedy) or a finite number >= 0.001 (sampling)"),
    (["--temperature", "nan"], "--temperature nan: expected 0 (greedy)"),
    (["--temperature", "0.0001"], "--temperature 0.0001: expected 0 (greedy)"),
    (["--top-k", "-2"], "--top-k -2: expected an integer >= 1 (or 0: no top-k filtering)"),
    (["--top-p", "0"], "--top-p 0.0: top_p must be a number in (0, 1]"),
    (["--seed", "-1"], "--seed -1: expected an integer in 0..2**64-1"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: expected a finite number above 0 (1: none)"),
    (["--repetition-penalty", "inf"], "--repetition-penalty inf: expected a finite number above 0 (1: none)"),
])
def test_a_flag_out_of_range_is_named(ckpt, capsys, argv, message):
    err = one_error(capsys, [str(ckpt), "--prompt", "hi", *argv])
    assert err.startswith(f"error: {message}") and "generate()" not in err


def test_a_hub_id_gets_the_download_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))  # an empty cache, not the user's
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    err = one_error(capsys, ["meta-llama/Llama-3.2-1B", "--prompt", "hi"])
    assert err == (f"error: meta-llama/Llama-3.2-1B is not in the Hugging Face cache ({tmp_path}/cache/"
                   "models--meta-llama--Llama-3.2-1B): run `hf download meta-llama/Llama-3.2-1B` (HF_HUB_CACHE / "
                   "HF_HOME choose the cache), or pass --download to download it; it is the source of preset "
                   "'llama-3.2-1b'")
    err = one_error(capsys, ["someone/some-model", "--prompt", "hi"])
    assert "run `hf download someone/some-model`" in err and "preset" not in err
    err = one_error(capsys, ["Llama-3.2-1B", "--prompt", "hi"])  # a preset's name, in any case: no weights
    assert err.endswith("'Llama-3.2-1B' is a preset, which has random weights: pass its checkpoint "
                        "(meta-llama/Llama-3.2-1B, once in the Hugging Face cache)")
    # a path is a path: no hub hint for ./x, /abs/x, a/b/c
    for name in ("./x", str(tmp_path / "x"), "a/b/c"):
        assert "hub id" not in one_error(capsys, [name, "--prompt", "hi"])
