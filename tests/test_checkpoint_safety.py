"""Hostile and careless checkpoints: every file zoo opens stays inside the checkpoint directory and is a regular
file, the index decides between duplicate tensors, pickles are never unpickled; each case is one ZooError (exit 2
through the converter CLI) and leaves no output behind."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir
from safetensors.torch import load_file, save_file

import zoo
from convert import hf_to_zoo
from convert.common import run_cli

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A private copy of the sharded llama fixture (two shards and an index)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("llama"), dst, ignore=shutil.ignore_patterns("golden.safetensors", "README.md"),
                    copy_function=shutil.copyfile)  # contents only: the copies are writable whatever the source's mode
    return dst


def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / INDEX).read_text())
    edit(index["weight_map"])
    (ckpt / INDEX).write_text(json.dumps(index))


def _refused(ckpt: Path, tmp_path: Path, match: str, capsys) -> None:
    """zoo.load raises a ZooError matching `match`; the converter prints it on one line, exits 2, writes nothing."""
    with pytest.raises(zoo.ZooError, match=match):
        zoo.load(ckpt)
    capsys.readouterr()
    dst = tmp_path / "out"
    assert run_cli(hf_to_zoo.main, [str(ckpt), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "/tmp/elsewhere.safetensors", "", 7])
def test_index_names_outside_the_directory_are_refused(ckpt, tmp_path, capsys, name):
    shutil.copy(ckpt / SHARD1, tmp_path / "elsewhere.safetensors")
    _edit_index(ckpt, lambda wm: wm.update({k: name for k, v in wm.items() if v == SHARD1}))
    _refused(ckpt, tmp_path, "not a plain file name inside the checkpoint directory", capsys)


def test_a_shard_symlinked_out_of_the_directory_is_refused(ckpt, tmp_path, capsys):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(ckpt / SHARD1, outside)
    (ckpt / SHARD1).symlink_to(outside)
    _refused(ckpt, tmp_path, "outside the checkpoint directory", capsys)


def test_config_linked_to_a_system_file_is_refused(ckpt, tmp_path, capsys):
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("/etc/passwd")
    _refused(ckpt, tmp_path, "outside the checkpoint directory", capsys)


def test_a_fifo_is_refused_not_waited_on(ckpt, tmp_path, capsys):
    (ckpt / SHARD2).unlink()
    os.mkfifo(ckpt / SHARD2)
    _refused(ckpt, tmp_path, "not a regular file", capsys)


def test_a_tokenizer_file_linked_out_is_not_copied(ckpt, tmp_path, capsys):
    (ckpt / "tokenizer.json").symlink_to("/etc/passwd")
    dst = tmp_path / "out"
    assert run_cli(hf_to_zoo.main, [str(ckpt), str(dst), "--quiet"]) == 2
    assert "tokenizer file" in capsys.readouterr().err
    assert not dst.exists()


def test_the_index_decides_between_duplicate_tensors(ckpt, tmp_path):
    """lm_head also in shard 1, zeroed: the index names shard 2, so shard 2's weights load."""
    index = json.loads((ckpt / INDEX).read_text())["weight_map"]
    head_file = index["lm_head.weight"]
    other = SHARD1 if head_file == SHARD2 else SHARD2
    tensors = load_file(ckpt / other)
    real = load_file(ckpt / head_file)["lm_head.weight"]
    tensors["lm_head.weight"] = torch.zeros_like(real)
    save_file(tensors, ckpt / other, metadata={"format": "pt"})
    model = zoo.load(ckpt)
    assert torch.equal(model.lm_head.weight, real)
    # without an index nothing says which copy is the model's: an error naming both files
    (ckpt / INDEX).unlink()
    (ckpt / SHARD1).rename(ckpt / "a.safetensors")
    (ckpt / SHARD2).rename(ckpt / "b.safetensors")
    with pytest.raises(zoo.ZooError, match=r"'lm_head.weight' is in two files, a.safetensors and b.safetensors"):
        zoo.load(ckpt)


class _Planted:
    """Unpickling this creates a file: the proof that a loader ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_malicious_pickle_never_runs(ckpt, tmp_path, capsys):
    planted = tmp_path / "PWNED"
    for p in ckpt.glob("*.safetensors"):
        p.unlink()
    (ckpt / INDEX).unlink()
    with open(ckpt / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Planted(str(planted))}, f)
    _refused(ckpt, tmp_path, "only pickle weights.*refuses", capsys)
    # the same pickle under a safetensors name: a corrupt file, still never unpickled
    (ckpt / "pytorch_model.bin").rename(ckpt / "model.safetensors")
    _refused(ckpt, tmp_path, "corrupt or truncated safetensors", capsys)
    assert not planted.exists()


@pytest.mark.parametrize("config", [[1, 2], {"model_type": ["llama"]}, {"format": "zoo", "family": 3}, "\ud800"])
def test_config_json_that_is_no_config(ckpt, tmp_path, capsys, config):
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, tmp_path, "config.json", capsys)


def test_dst_that_is_or_holds_src_is_refused_even_with_force(ckpt, tmp_path, capsys):
    for dst in (ckpt, tmp_path):
        assert run_cli(hf_to_zoo.main, [str(ckpt), str(dst), "--force", "--quiet"]) == 2
        assert "is SRC" in capsys.readouterr().err
    assert (ckpt / INDEX).is_file() and (ckpt / SHARD1).is_file()


def test_a_killed_conversion_leaves_nothing_the_next_one_keeps(ckpt, tmp_path, capsys):
    """A temporary directory of a killed run (its process gone) is removed by the next write of the same DST;
    one of a live process is not."""
    dead = tmp_path / ".out.tmp-999999999-abc"
    live = tmp_path / f".out.tmp-{os.getpid()}-xyz"
    dead.mkdir()
    live.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    assert run_cli(hf_to_zoo.main, [str(ckpt), str(tmp_path / "out"), "--quiet"]) == 0
    assert not dead.exists() and live.is_dir() and "killed" in capsys.readouterr().err


@pytest.mark.parametrize("field, value, match", [
    ("num_hidden_layers", 1e9, "n_layers must be a positive integer, got 1000000000.0"),
    ("num_hidden_layers", 10**9, "about .* parameters, above"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number above 0, got nan"),
    ("rms_norm_eps", -1e-5, "norm_eps must be a finite number above 0"),
    ("hidden_size", "64", "dim must be a positive integer, got '64'"),
    ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "unsupported rope scaling 'yarn'.*default, llama3"),
])
def test_config_values_out_of_range_are_refused_before_anything_is_built(ckpt, tmp_path, capsys, field, value, match):
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    config.pop("rope_parameters", None)  # transformers 5's spelling of rope_theta/rope_scaling would win
    (ckpt / "config.json").write_text(json.dumps(config))
    _refused(ckpt, tmp_path, match, capsys)


def test_a_full_disk_is_one_line_and_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    import errno

    import zoo.io.safetensors

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zoo.io.safetensors, "save_file", full)
    dst = tmp_path / "out"
    assert run_cli(hf_to_zoo.main, [str(ckpt), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: No space left on device") and len(err.splitlines()) == 1
    assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("size", ["nan", "0", "-1", "inf"])
def test_a_shard_size_that_is_no_size(ckpt, tmp_path, capsys, size):
    assert run_cli(hf_to_zoo.main, [str(ckpt), str(tmp_path / "out"), "--shard-size", size, "--quiet"]) == 2
    assert "--shard-size must be a finite number of GiB above 0" in capsys.readouterr().err


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path, capsys):
    src = tmp_path / "internlm2"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(fixture_dir("internlm2") / name, src / name)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.attention.wqkv.weight"] = tensors["model.layers.0.attention.wqkv.weight"][:-8].clone()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    _refused(src, tmp_path, r"cannot make layers\.0\.attn\.q_proj\.weight from model\.layers\.0\.attention\.wqkv"
                            r"\.weight \[88, 64\]", capsys)


def test_an_integer_weight_is_refused(ckpt, tmp_path, capsys):
    tensors = load_file(ckpt / SHARD1)
    name = next(iter(tensors))
    tensors[name] = tensors[name].view(torch.int32)  # same bytes, the header says int32
    save_file(tensors, ckpt / SHARD1, metadata={"format": "pt"})
    _refused(ckpt, tmp_path, f"tensor {name} has dtype torch.int32; a model weight must be a floating", capsys)
