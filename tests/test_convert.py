"""Converters: round trips, transformers loading zoo_to_hf output, and every bad input gets a one-line error."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from convert import hf_to_zoo, zoo_to_hf
from convert.common import run_cli
from zoo.io.safetensors import SafetensorsDir

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    reader = SafetensorsDir(path)
    return {n: reader.get(n) for n in reader.names()}


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args), "--quiet"], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory):
    """A tiny Llama-3.2 style checkpoint (tied embeddings) written by transformers, with a tokenizer file."""
    path = tmp_path_factory.mktemp("hf") / "tied"
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_fixture_round_trip_is_bit_exact(tmp_path):
    """hf -> zoo -> hf on the sharded fixture: same names, dtypes and bits; the HF output loads in transformers."""
    from conftest import fixture_dir

    src = fixture_dir("llama")
    r1 = cli("convert.hf_to_zoo", src, tmp_path / "zoo")
    assert r1.returncode == 0, r1.stderr
    r2 = cli("convert.zoo_to_hf", tmp_path / "zoo", tmp_path / "hf", "--shard-size", "0.0001")
    assert r2.returncode == 0, r2.stderr
    a, b = tensors_of(src), tensors_of(tmp_path / "hf")
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # 0.0001 GiB shards: several files

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    model, info = hf
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    golden = load_file(src / "golden.safetensors")
    with torch.no_grad():
        logits = model(golden["doc1.input_ids"]).logits
    torch.testing.assert_close(logits, golden["doc1.logits"], atol=1e-4, rtol=1e-4)
    # the special-token ids travel too (zoo used to drop them, and transformers then assumed its defaults)
    original, written = (json.loads((d / "config.json").read_text()) for d in (src, tmp_path / "hf"))
    for key in ("bos_token_id", "eos_token_id"):
        assert written[key] == original[key], key
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (original["bos_token_id"],
                                                                        original["eos_token_id"])


def test_converters_end_with_what_they_wrote(tmp_path, capsys):
    """Without --quiet, each converter's last line says what it wrote: where, tensors, size, shards, seconds."""
    from conftest import fixture_dir

    assert hf_to_zoo.main([str(fixture_dir("llama")), str(tmp_path / "zoo")]) is None
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--shard-size", "0.0001"]) is None
    last = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'zoo'))}: \d+ tensors, [\d.]+ MiB in 1 shard, [\d.]+ s",
                        last[0]), last
    assert re.fullmatch(r"wrote .*/hf: \d+ tensors, [\d.]+ MiB in \d+ shards, [\d.]+ s", last[1]), last


def test_tied_round_trip_and_transformers_load(tmp_path, hf_tied):
    assert hf_to_zoo.main([str(hf_tied), str(tmp_path / "zoo"), "--quiet"]) is None
    assert (tmp_path / "zoo" / "tokenizer.json").exists()  # tokenizer files travel along
    zoo_tensors = tensors_of(tmp_path / "zoo")
    assert "lm_head.weight" not in zoo_tensors
    zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"])
    a, b = tensors_of(hf_tied), tensors_of(tmp_path / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 128, (11,))
    ours = zoo.load(tmp_path / "zoo", attn="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_generation_config_ids_win_and_travel(tmp_path):
    """generation_config.json's ids win over config.json's, as in transformers' generate (Llama-3-8B-Instruct's
    config.json names only <|end_of_text|>, its generation_config.json also <|eot_id|>): zoo.generate stops at
    them, and zoo_to_hf writes them back, keeping the file's sampling settings."""
    from conftest import fixture_dir

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("llama"), src, ignore=shutil.ignore_patterns("golden.safetensors"))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7],
                                                            "do_sample": True, "temperature": 0.6}))
    assert zoo.load(src, device="meta").eos_token_ids == (2, 7)
    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None
    model = zoo.load(tmp_path / "zoo")
    assert (model.config.bos_token_id, model.eos_token_ids, model.config.pad_token_id) == (1, (2, 7), None)
    zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, [2, 7]) and "pad_token_id" not in config
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.eos_token_id, generation.temperature, generation.do_sample) == ([2, 7], 0.6, True)


def test_export_generates_and_stops_at_end_of_turn(tmp_path):
    """A zoo model with no ids in its config, saved with the bundled tokenizer: zoo.save and zoo_to_hf take them
    from the tokenizer (bos <s>, pad <pad>, eos </s> and its chat template's end of turn <|im_end|>), so
    transformers' generate stops where the answer ends; zoo.generate on the result stops there too, by default."""
    from recipes.data.tokenizer_choice import ASSETS
    from zoo.generate import generate
    from zoo.io.tokenizer import Tokenizer, render

    tok = Tokenizer(ASSETS)
    eot = tok.token_to_id("<|im_end|>")
    text = render([{"role": "user", "content": "What does a list hold?"}], "auto", tok, add_generation_prompt=True)
    prompt = torch.tensor(tok.encode(text.text, add_special_tokens=False))
    model = zoo.load("debug", attn="sdpa")
    free = generate(model, [prompt], max_new_tokens=12, stop=[])[0].tolist()
    # let the model answer with <|im_end|> at step k: swap its head row with that of the token it picked there
    k = next(i for i in range(2, 11) if free[i] not in free[:i] and eot not in free[: i + 1])
    with torch.no_grad():
        w = model.lm_head.weight
        w[[free[k], eot]] = w[[eot, free[k]]]
    expected = [*free[:k], eot]  # shorter than max_new_tokens: generation has to stop there
    zoo.save(model, tmp_path / "zoo", tokenizer_from=ASSETS)  # the debug preset names no ids: the tokenizer's
    assert zoo.load(tmp_path / "zoo").eos_token_ids == (1, eot)
    # a zoo checkpoint without them (written before zoo kept them): zoo_to_hf asks its tokenizer
    config = json.loads((tmp_path / "zoo" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        del config["config"][key]
    (tmp_path / "zoo" / "config.json").write_text(json.dumps(config))
    zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"])

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    ids = {"bos_token_id": 0, "eos_token_id": [1, eot], "pad_token_id": 2}  # <s>, </s> + <|im_end|>, <pad>
    assert {k: config[k] for k in ids} == ids and generation == {**ids, "repetition_penalty": 1.2}  # the bundled
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    out = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=12,
                      do_sample=False, repetition_penalty=1.0)  # not the bundled 1.2: it penalises <|im_end|>
    assert out[0, len(prompt):].tolist() == expected
    back = zoo.load(tmp_path / "hf", attn="sdpa")
    assert back.eos_token_ids == (1, eot)
    assert generate(back, [prompt], max_new_tokens=12)[0].tolist() == expected


def test_llava_export_gets_a_real_image_token(tmp_path):
    """A LLaVA with the original code's -200 placeholder (the recipes' debug LLaVA) exports with the tokenizer's
    <image>: added to the bundled tokenizer as id 2048, one past the vocabulary, so the embedding and head grow by
    a row. transformers, which raised IndexError on -200, then runs images with zoo's logits."""
    from recipes.data.tokenizer_choice import ASSETS
    from recipes.llava import debug_llava
    from zoo.core.layers import init_weights
    from zoo.models.llava import Llava

    torch.manual_seed(0)
    model = Llava(debug_llava(), attn="eager")
    init_weights(model)
    assert model.config.image_token_id == -200 and model.config.language.vocab_size == 2048
    zoo.save(model, tmp_path / "zoo", tokenizer_from=ASSETS)
    zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"])

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["image_token_index"], config["text_config"]["vocab_size"]) == (2048, 2049)
    assert config["text_config"]["eos_token_id"] == [1, 4]
    # the export's tokenizer adds the bos (0) as zoo does, then the real <image> id
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").encode("<image>") == [0, 2048]
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    P = model.config.image_tokens
    text = torch.tensor([0, 3, 400, 203])
    pixels = torch.randn(3, 32, 32)
    with torch.no_grad():
        ours = model(zoo.pack([torch.cat([text, torch.full((P,), -200), text])], images=[pixels]))
        theirs = hf(input_ids=torch.cat([text, torch.full((P,), 2048), text])[None], pixel_values=pixels[None]).logits
    torch.testing.assert_close(theirs[0, :, :2048], ours, atol=1e-4, rtol=1e-4)
    assert zoo.load(tmp_path / "hf").config.image_token_id == 2048


def test_unreadable_tokenizer_when_ids_are_needed(tmp_path, capsys):
    """No eos id in the zoo config and a broken tokenizer.json to take it from: one line, nothing written."""
    zoo.save(zoo.load("debug"), tmp_path / "zoo")
    (tmp_path / "zoo" / "tokenizer.json").write_text("{}")
    assert run_cli(zoo_to_hf.main, [str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tokenizer.json" in err[0], err
    assert_nothing_written(tmp_path / "hf")


def test_zoo_save_load_round_trip(tmp_path):
    model = zoo.load("debug", attn="sdpa")
    zoo.save(model, tmp_path / "ck", max_shard_bytes=1 << 20)
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    again = zoo.load(tmp_path / "ck", attn="sdpa")
    for (n, p), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n == n2 and torch.equal(p, p2)
    same = zoo.load("debug", checkpoint=tmp_path / "ck", dtype=torch.bfloat16)
    assert same.embed.weight.dtype == torch.bfloat16
    with pytest.raises(zoo.ZooError, match="not a llama-3.2-1b checkpoint"):
        zoo.load("llama-3.2-1b", checkpoint=tmp_path / "ck", device="meta")
    with pytest.raises(zoo.ZooError, match="exists and is not empty"):
        zoo.save(model, tmp_path / "ck")
    zoo.save(model, tmp_path / "ck", force=True)


def test_load_dtype_and_device_meta_build(tmp_path, hf_tied):
    model = zoo.load(hf_tied, dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    for name, want in (("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
                       ("torch.float16", torch.float16)):
        assert zoo.load(hf_tied, dtype=name, device="meta").embed.weight.dtype == want
    with pytest.raises(zoo.ZooError, match="dtype 'int8' is not one.*float32, fp32, bfloat16, bf16, float16, fp16"):
        zoo.load(hf_tied, dtype="int8")
    assert model.head_weight is model.embed.weight


# ---- bad input: one line on stderr, exit code 2, nothing left behind ----


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_config(tmp_path):
    (tmp_path / "src").mkdir()
    r = cli("convert.hf_to_zoo", tmp_path / "src", tmp_path / "out")
    assert_one_line_error(r, "config.json not found")
    assert_nothing_written(tmp_path / "out")


def test_unknown_model_type(tmp_path, hf_tied):
    src = broken_copy(hf_tied, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(cfg))
    r = cli("convert.hf_to_zoo", src, tmp_path / "out")
    assert_one_line_error(r, "unknown model_type 'gpt_neox'", "llama")
    assert_nothing_written(tmp_path / "out")


def test_missing_and_unexpected_tensors(tmp_path, hf_tied):
    src = broken_copy(hf_tied, tmp_path / "src")
    t = load_file(src / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.7.extra.weight"] = torch.zeros(2)
    save_file(t, src / "model.safetensors")
    r = cli("convert.hf_to_zoo", src, tmp_path / "out")
    assert_one_line_error(r, "missing tensors: model.layers.1.mlp.up_proj.weight",
                          "unexpected tensors: model.layers.7.extra.weight")
    assert_nothing_written(tmp_path / "out")
    with pytest.raises(zoo.ZooError, match="missing tensors"):
        zoo.load(src)


def test_which_safetensors_files_are_weights(tmp_path):
    """The shards an index names; else model.safetensors alone, as transformers reads it (a file beside it, like
    the fixtures' golden.safetensors, is not a weight); else every *.safetensors (a PEFT adapter's file)."""
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    save_file({"outputs": torch.ones(3)}, tmp_path / "golden.safetensors")
    assert SafetensorsDir(tmp_path).names() == ["w"]
    (tmp_path / "model.safetensors").rename(tmp_path / "adapter_model.safetensors")
    assert sorted(SafetensorsDir(tmp_path).names()) == ["outputs", "w"]
    index = {"weight_map": {"w": "adapter_model.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert SafetensorsDir(tmp_path).names() == ["w"]


def test_shape_mismatch(tmp_path, hf_tied):
    src = broken_copy(hf_tied, tmp_path / "src")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(24, 32)
    save_file(t, src / "model.safetensors")
    r = cli("convert.hf_to_zoo", src, tmp_path / "out")
    assert_one_line_error(r, "model.layers.0.self_attn.k_proj.weight", "expected [16, 32]", "got [24, 32]")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_truncated_or_corrupt_safetensors(tmp_path, hf_tied, damage):
    src = broken_copy(hf_tied, tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    bad = data[: len(data) // 2] if damage == "truncated" else data[:8] + b"#" * 40 + data[48:]
    (src / "model.safetensors").write_bytes(bad)
    r = cli("convert.hf_to_zoo", src, tmp_path / "out")
    assert_one_line_error(r, "corrupt or truncated safetensors", "model.safetensors")
    assert_nothing_written(tmp_path / "out")


def test_pickle_checkpoint_is_refused(tmp_path, hf_tied):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_tied / "config.json", src / "config.json")
    (src / "pytorch_model.bin").write_bytes(b"not even looked at")
    r = cli("convert.hf_to_zoo", src, tmp_path / "out")
    assert_one_line_error(r, "pickle", "unpickling can run arbitrary code")
    assert_nothing_written(tmp_path / "out")


def test_non_empty_destination_needs_force(tmp_path, hf_tied):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = cli("convert.hf_to_zoo", hf_tied, out)
    assert_one_line_error(r, "exists and is not empty", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    r = cli("convert.hf_to_zoo", hf_tied, out, "--force")
    assert r.returncode == 0, r.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_failure_midway_leaves_nothing(tmp_path, hf_tied, monkeypatch):
    """An error after some tensors were written removes the temporary directory."""
    import convert.common

    def boom(*a, **k):
        raise zoo.ZooError("disk full (simulated)")

    monkeypatch.setattr(convert.common.ShardWriter, "finish", boom)
    assert run_cli(hf_to_zoo.main, [str(hf_tied), str(tmp_path / "out"), "--quiet"]) == 2
    assert_nothing_written(tmp_path / "out")


def test_wrong_direction_is_explained(tmp_path, hf_tied):
    r = cli("convert.zoo_to_hf", hf_tied, tmp_path / "out")
    assert_one_line_error(r, "not a zoo checkpoint", "convert.hf_to_zoo")


def test_output_directory_has_ordinary_permissions(tmp_path):
    import os

    zoo.save(zoo.load("debug", device="cpu"), tmp_path / "ck")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o777 & ~umask
    # the weights too: safetensors 0.8 writes its files 0600; they get the mode config.json has
    config_mode = (tmp_path / "ck" / "config.json").stat().st_mode & 0o777
    assert config_mode == 0o666 & ~umask
    assert (tmp_path / "ck" / "model.safetensors").stat().st_mode & 0o777 == config_mode
    cli("convert.zoo_to_hf", tmp_path / "ck", tmp_path / "hf")
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {config_mode}
