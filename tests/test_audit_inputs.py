"""Careless and hostile command-line input beyond the "What zoo refuses" table (docs/refuses.md): config files that
are not a mapping of options, counts that are not integers, a seed or LoRA rank that would overflow or allocate
terabytes, LLaVA image paths reaching outside the image folder or naming what is not an image, non-UTF-8 text for
zoo.generate, roles a chat template would render but never train, an --out whose --force would delete the run's own
input, a file or device as an output directory. Each is one ZooError naming what was expected and what came."""

import io
import json
import os
import struct
import zlib

import pytest
import torch

import zoo
from recipes import pretrain
from recipes.data.chat import check_messages
from recipes.data.jsonl import list_files
from recipes.data.llava import LlavaData, load_image, read_llava
from recipes.data.tokenizer_choice import ASSETS
from recipes.engine.config import parse
from recipes.llava import debug_llava
from recipes.llava import main as llava_main
from recipes.pretokenize import main as tokenize_main
from recipes.pretrain import PretrainConfig
from zoo.errors import ZooError
from zoo.generate.cli import main as generate_main
from zoo.io.atomic import atomic_dir
from zoo.io.tokenizer import Tokenizer
from zoo.train.lora import LoRAConfig, apply_lora

TINY = ["--seq-len", "64", "--batch-tokens", "128", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "- 1\n- 2\n", "expected a mapping of option names to values, got list"),
    ("c.json", "[1, 2]", "expected a mapping of option names to values, got list"),
    ("c.json", "{bad", "not valid JSON"),
    ("c.yaml", "a: [\n", "not valid YAML"),
    ("c.toml", b"\xe2\x28\xa1 = 1", "not UTF-8 text (byte 0xe2 at offset 0)"),
    ("c.toml", "seq_len = 1.5\n", "option seq_len must be an integer, got 1.5"),
    ("c.toml", "steps = 1e30\n", "option steps must be an integer, got 1e+30"),
    ("c.yaml", "1: 2\n", "unknown options 1;"),
    ("c.toml", "# " + "x" * (1 << 20), "expected at most 1,048,576 bytes of options"),
])
def test_a_config_file_that_is_not_options_is_one_error(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ZooError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse(PretrainConfig, ["--config", str(path)])


def test_a_config_directory_is_not_a_missing_file(tmp_path):
    (tmp_path / "c.toml").mkdir()
    with pytest.raises(ZooError, match="expected a regular file .*, got a directory"):
        parse(PretrainConfig, ["--config", str(tmp_path / "c.toml")])


def test_a_seed_past_what_torch_takes_is_named():
    with pytest.raises(ZooError, match=r"--seed must be an integer in 0\.\.4294967295, got 10{30}"):
        parse(PretrainConfig, ["--seed", str(10**30)])
    assert parse(PretrainConfig, ["--seed", str(2**32 - 1)]).run.seed == 2**32 - 1


def test_a_lora_rank_past_the_layers_is_refused_before_allocating():
    model = zoo.load("debug", device="meta")
    with pytest.raises(ZooError, match=r"LoRA rank 1000000000 is above layers\.0\.attn\.q_proj's smaller dimension"):
        apply_lora(model, LoRAConfig(10**9, 8.0, 0.0, False, ("q_proj",)))


def test_force_never_replaces_a_file_or_device_with_a_directory(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for dst in (mine, "/dev/null"):
        with pytest.raises(ZooError, match="exists and is not a directory"):
            with atomic_dir(dst, force=True):
                pass
    assert mine.read_text() == "mine" and os.path.exists("/dev/null") and not os.path.isdir("/dev/null")


def test_force_never_removes_the_runs_own_model(tmp_path):
    out = tmp_path / "run"
    pretrain.main(["--steps", "1", "--out", str(out), *TINY])
    before = sorted(p.name for p in (out / "model").iterdir())
    with pytest.raises(ZooError, match="--force would remove .*model, which holds this run's input"):
        pretrain.main(["--steps", "1", "--out", str(out), "--model", str(out / "model"), "--force", *TINY])
    assert sorted(p.name for p in (out / "model").iterdir()) == before


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _llava(tmp_path, image) -> LlavaData:
    rows = [{"image": image, "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                               {"from": "gpt", "value": "Red."}]}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    return LlavaData(str(tmp_path / "data.json"), str(tmp_path / "images"), Tokenizer(ASSETS), 256, 0, debug_llava())


@pytest.mark.parametrize("image, message", [
    ("ABS", "is not a plain file name inside the image folder"),
    ("../secret.png", "is not a plain file name inside the image folder"),
    (5, "image 5 is not a plain file name inside the image folder"),
    ("../nope.png", "is not a plain file name inside the image folder"),
])
def test_llava_images_stay_inside_the_image_folder(tmp_path, image, message):
    from PIL import Image

    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "secret.png")
    image = str(tmp_path / "secret.png") if image == "ABS" else image
    with pytest.raises(ZooError, match=r"data\.json:1: .*" + message + r".* \(--image-folder is "):
        _llava(tmp_path, image)


def test_a_non_image_or_a_decompression_bomb_is_one_error(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "text.png").write_text("hello")
    (tmp_path / "images" / "bomb.png").write_bytes(_png_header(100_000, 100_000))
    vision = debug_llava().vision
    with pytest.raises(ZooError, match="text.png: not an image Pillow can read"):
        load_image(tmp_path / "images" / "text.png", vision)
    with pytest.raises(ZooError, match="bomb.png: not an image Pillow can read .*DecompressionBomb"):
        load_image(tmp_path / "images" / "bomb.png", vision)
    (tmp_path / "images" / "bomb.png").write_bytes(_png_header(12_000, 12_000))  # past the bound, under twice it
    with pytest.raises(ZooError, match="bomb.png: not an image Pillow can read .*DecompressionBombWarning"):
        load_image(tmp_path / "images" / "bomb.png", vision)


def test_llava_json_that_is_not_utf8_is_one_error(tmp_path):
    (tmp_path / "data.json").write_bytes(b"[\xff]")
    with pytest.raises(ZooError, match=r"data\.json: not UTF-8 \(byte 0xff at offset 1\)"):
        list(read_llava(str(tmp_path / "data.json")))


def test_llava_language_must_be_a_directory(tmp_path):
    (tmp_path / "lm.json").write_text("{}")
    with pytest.raises(ZooError, match="--language .*lm.json: expected a zoo checkpoint directory .* got a file"):
        llava_main(["--language", str(tmp_path / "lm.json"), "--out", str(tmp_path / "out"), *TINY])


def test_chat_roles_a_template_would_not_train_are_refused(tmp_path):
    for role in ("gpt", "asistant"):
        obj = {"messages": [{"role": role, "content": "x"}, {"role": "assistant", "content": "y"}]}
        with pytest.raises(ZooError, match=f"c.jsonl:3: expected roles system, developer, user, assistant, tool, "
                                           f"ipython, function, got '{role}'"):
            check_messages(tmp_path / "c.jsonl", 3, obj)
    assert check_messages(tmp_path / "c.jsonl", 1, {"messages": [{"role": "tool", "content": "x"}]})


def test_a_fifo_or_device_as_data_is_not_called_missing(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")
    for data in (tmp_path / "fifo.jsonl", "/dev/zero"):
        with pytest.raises(ZooError, match="is not a regular file"):
            list_files(data)
        with pytest.raises(ZooError, match="is not a regular file"):
            tokenize_main([str(data), str(tmp_path / "out"), "--tokenizer", str(ASSETS)])


@pytest.mark.parametrize("src, flags, message", [
    ("corpus.jsonl", ["--chunk-mb", "inf"], "--chunk-mb must be a finite number above 0, got inf"),
    # a SRC that is not there: code that took the count would stop at SRC, not start a million processes
    ("missing.jsonl", ["--workers", str(10**6)], "--workers must be between 1 and"),
])
def test_tokenize_flags_out_of_range(tmp_path, src, flags, message):
    with pytest.raises(ZooError, match=message):
        tokenize_main([str(ASSETS / src), str(tmp_path / "out"), "--tokenizer", str(ASSETS), *flags])
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("audit") / "ckpt"
    zoo.save(zoo.load("debug"), path, tokenizer_from=ASSETS)
    return path


def test_generate_refuses_text_that_is_not_utf8(ckpt, capsys):
    # bytes that were not UTF-8 reach Python as lone surrogates (surrogateescape: argv, a C-locale stdin)
    assert generate_main([str(ckpt), "--prompt", "a\udcffb"]) == 2
    assert capsys.readouterr().err.strip() == "error: --prompt: expected UTF-8 text, got byte 0xff at column 2"
    stdin = io.StringIO("hi\nthere \udcfe\n")
    assert generate_main([str(ckpt), "--chat", "--max-new-tokens", "2"], stdin=stdin, stdout=io.StringIO()) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: stdin line 2: expected UTF-8 text, got byte "
                                                                "0xfe at column 7")
    strict = io.TextIOWrapper(io.BytesIO(b"hi \xff\n"), encoding="utf-8")
    assert generate_main([str(ckpt), "--chat", "--max-new-tokens", "2"], stdin=strict, stdout=io.StringIO()) == 2
    assert capsys.readouterr().err.strip() == "error: stdin line 1: expected UTF-8 text, got byte 0xff"
