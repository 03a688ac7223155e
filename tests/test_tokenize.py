"""recipes.pretokenize and the memory-mapped dataset: the same tokens and packs as the JSONL path, the same losses,
exact resume and dp=2 on it, and the errors."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_recipes import CPU, ROOT, TINY, env, grad_norms, kill_after_first_checkpoint, losses

import zoo
from recipes import pretokenize, pretrain
from recipes.data import PretrainData, TokenData, pretrain_data
from recipes.data.tokenizer_choice import ASSETS, Tokenizer
from zoo.errors import ZooError


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ASSETS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSONL files (one with a blank line and an empty document), in a directory."""
    root = tmp_path_factory.mktemp("corpus")
    lines = [json.loads(x)["text"] for x in (ASSETS / "corpus.jsonl").read_text().splitlines()[:12]]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t[:1500]}) + "\n" for t in lines[:6]) + "\n")
    (root / "sub").mkdir()
    rows = [{"text": t[:1500]} for t in lines[6:]] + [{"text": ""}, {"text": "tail document"}]
    (root / "sub" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "ds"
    # tiny chunks: several shards per file, so windows cross shard boundaries
    pretokenize.main([str(corpus), str(out), "--tokenizer", str(ASSETS), "--chunk-mb", "0.002", "--no-progress"])
    return out


def test_round_trip_equals_in_memory_tokenization(corpus, dataset, tok):
    m = json.loads((dataset / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and len(m["shards"]) > 2
    assert [s["path"] for s in m["sources"]] == ["a.jsonl", "sub/b.jsonl"]
    stream = np.concatenate([np.fromfile(dataset / s["file"], dtype=np.uint16) for s in m["shards"]])
    ref = PretrainData(str(corpus), tok, 16, seed=0)
    full = []  # the whole stream, uncut: <s> ids </s> per non-empty document
    for f in sorted(corpus.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip() and (ids := tok.encode(json.loads(line)["text"], add_special_tokens=False)):
                full += [tok.bos_id, *ids, tok.eos_id]
    assert stream.tolist() == full
    assert m["tokens"] == ref.stats["tokens"] and m["documents"] == ref.stats["documents"]
    starts = np.load(dataset / "documents.npy")
    assert starts[-1] == len(full) and (stream[starts[:-1]] == tok.bos_id).all()
    # every pack, over two epochs, and its target count
    data = TokenData(dataset, tok, 16, seed=3)
    ref = PretrainData(str(corpus), tok, 16, seed=3)
    assert len(data) == len(ref)
    for g in range(2 * len(ref)):
        a, b = ref.pack(g), data.pack(g)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens), g
        assert torch.equal(a.labels, b.labels) and ref.num_loss_tokens(g) == data.num_loss_tokens(g), g


def test_workers_write_the_same_dataset(corpus, dataset, tmp_path):
    out = tmp_path / "w2"
    pretokenize.main([str(corpus), str(out), "--tokenizer", str(ASSETS), "--chunk-mb", "0.002", "--workers", "2",
                   "--no-progress"])
    for f in sorted(p.name for p in dataset.iterdir()):
        assert (out / f).read_bytes() == (dataset / f).read_bytes(), f


def test_jsonl_and_dataset_train_the_same_losses(corpus, dataset, tmp_path):
    args = ["--steps", "3", "--save-every", "0", *TINY, *CPU]
    from_jsonl = pretrain.main([*args, "--data", str(corpus), "--out", str(tmp_path / "j")])
    from_dataset = pretrain.main([*args, "--data", str(dataset), "--out", str(tmp_path / "d")])
    assert from_dataset == from_jsonl  # bit for bit


def test_dataset_sigkill_then_resume_equals_uninterrupted(tmp_path):
    ds = tmp_path / "ds"
    pretokenize.main([str(ASSETS / "corpus.jsonl"), str(ds), "--tokenizer", str(ASSETS), "--no-progress"])
    args = ["--data", str(ds), "--steps", "40", "--save-every", "2", "--seq-len", "32", "--batch-tokens", "64",
            "--no-progress", *CPU]
    out = tmp_path / "killed"
    kill_after_first_checkpoint(args, out)
    resumed = pretrain.main([*args, "--out", str(out), "--resume"])
    assert 0 < len(resumed) < 40
    whole = pretrain.main([*args, "--out", str(tmp_path / "whole")])
    assert losses(out) == whole  # bit-exact on CPU


def test_dataset_two_processes_equal_one(dataset, tmp_path):
    args = ["--data", str(dataset), "--steps", "3", "--save-every", "0", *TINY, *CPU]
    one = pretrain.main([*args, "--out", str(tmp_path / "one")])
    torch.manual_seed(0)
    zoo.save(zoo.load("debug"), tmp_path / "init", tokenizer_from=str(ASSETS))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "recipes.pretrain", *args, "--dp", "2", "--model", str(tmp_path / "init"), "--out",
           str(tmp_path / "dp2")]
    run = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(tmp_path / "dp2") == pytest.approx(one, abs=2e-5)
    assert grad_norms(tmp_path / "dp2") == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)


def test_bad_line_names_file_and_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    (src / "b.jsonl").write_text('{"text": "ok"}\n\n{"text": "ok"}\n{"text": 1}\n')
    with pytest.raises(ZooError, match=r"b\.jsonl:4: expected \{\"text\""):
        pretokenize.main([str(src), str(tmp_path / "o"), "--tokenizer", str(ASSETS), "--no-progress"])
    # the line number is the file's, also in a later chunk tokenized by a worker process
    (src / "b.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(40)) + "{oops\n")
    with pytest.raises(ZooError, match=r"b\.jsonl:41:2: malformed JSON"):
        pretokenize.main([str(src), str(tmp_path / "o"), "--tokenizer", str(ASSETS), "--no-progress",
                       "--chunk-mb", "0.0001", "--workers", "2"])
    assert not any(tmp_path.glob(".o*")) and not (tmp_path / "o").exists()  # nothing half-written
    run = subprocess.run([sys.executable, "-m", "recipes.pretokenize", str(src), str(tmp_path / "o"), "--tokenizer",
                          str(ASSETS)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "b.jsonl:41:2" in run.stderr


def test_rerun_is_a_noop_and_a_different_out_is_refused(tmp_path, capsys):
    src, out = tmp_path / "c.jsonl", tmp_path / "ds"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(10)))
    base = [str(src), str(out), "--tokenizer", str(ASSETS), "--no-progress"]
    pretokenize.main(base)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    pretokenize.main(base)
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    src.write_text(src.read_text().replace("document", "text"))
    with pytest.raises(ZooError, match="exists and holds a dataset of other sources.*--force"):
        pretokenize.main(base)
    pretokenize.main([*base, "--force"])
    assert json.loads((out / "manifest.json").read_text())["sources"][0]["bytes"] == src.stat().st_size
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(ZooError, match="exists and holds other files"):
        pretokenize.main([str(src), str(tmp_path / "other"), "--tokenizer", str(ASSETS)])
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    # --force replaces only a dataset this command wrote: never a user's files, never the tokenizer's directory
    with pytest.raises(ZooError, match=r"holds other files \(keep.txt\), not a dataset recipes.pretokenize wrote"):
        pretokenize.main([str(src), str(tmp_path / "other"), "--tokenizer", str(ASSETS), "--force"])
    assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
    tok_dir = tmp_path / "tok"
    shutil.copytree(ASSETS, tok_dir)
    with pytest.raises(ZooError, match="holds the tokenizer"):
        pretokenize.main([str(src), str(tok_dir), "--tokenizer", str(tok_dir), "--force"])
    assert (tok_dir / "tokenizer.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    pretokenize.main([str(src), str(empty), "--tokenizer", str(ASSETS), "--no-progress"])  # an empty directory: fine
    assert (empty / "manifest.json").is_file()


def test_manifest_of_another_tokenizer_is_refused(dataset, tmp_path):
    other = tmp_path / "tok"
    shutil.copytree(ASSETS, other, ignore=shutil.ignore_patterns("*.jsonl"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<pad>"  # the same vocabulary, another document wrapping: other tokens
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ZooError, match="tokenized with another tokenizer.*--tokenizer"):
        pretrain_data(str(dataset), Tokenizer(other), 16, 0)
    with pytest.raises(ZooError, match="tokenized with another tokenizer"):
        pretrain.main(["--data", str(dataset), "--tokenizer", str(other), "--out", str(tmp_path / "o"), *TINY])


def test_bad_sources_and_damaged_datasets(dataset, tmp_path, tok):
    with pytest.raises(ZooError, match="does not exist"):
        pretokenize.main([str(tmp_path / "none"), str(tmp_path / "o"), "--tokenizer", str(ASSETS)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ZooError, match="no .jsonl or .parquet files"):
        pretokenize.main([str(tmp_path / "empty"), str(tmp_path / "o"), "--tokenizer", str(ASSETS)])
    outside = tmp_path / "x.jsonl"
    outside.write_text('{"text": "secret"}\n')
    (tmp_path / "empty" / "link.jsonl").symlink_to(outside)
    with pytest.raises(ZooError, match="not a regular file inside"):
        pretokenize.main([str(tmp_path / "empty"), str(tmp_path / "o"), "--tokenizer", str(ASSETS)])
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "p").mkdir()
        (tmp_path / "p" / "a.parquet").write_bytes(b"PAR1")
        with pytest.raises(ZooError, match="Parquet needs pyarrow"):
            pretokenize.main([str(tmp_path / "p"), str(tmp_path / "o"), "--tokenizer", str(ASSETS)])
    damaged = tmp_path / "damaged"
    shutil.copytree(dataset, damaged)
    shard = sorted(damaged.glob("tokens-*.bin"))[-1]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ZooError, match="the dataset is damaged"):
        TokenData(damaged, tok, 16, 0)
    m = json.loads((damaged / "manifest.json").read_text())
    m["shards"][0]["file"] = "../x.jsonl"
    (damaged / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match="not a plain file name"):
        TokenData(damaged, tok, 16, 0)
    m["version"] = 99
    (damaged / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match="expected a zoo-tokens manifest version 1"):
        TokenData(damaged, tok, 16, 0)


def test_parquet_text_column_gives_the_jsonl_tokens(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"parquet document {i} " * (i + 1) for i in range(30)] + [""]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "p" / "a.parquet",
                   row_group_size=7)
    for name in ("j", "p"):
        pretokenize.main([str(tmp_path / name), str(tmp_path / f"{name}.ds"), "--tokenizer", str(ASSETS),
                          "--no-progress"])
    a, b = TokenData(tmp_path / "j.ds", tok, 16, 0), TokenData(tmp_path / "p.ds", tok, 16, 0)
    assert a.tokens(0, a.stats["tokens"]).tolist() == b.tokens(0, b.stats["tokens"]).tolist()
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p" / "b.parquet")
    with pytest.raises(ZooError, match=r"b\.parquet: expected a 'text' column"):
        pretokenize.main([str(tmp_path / "p"), str(tmp_path / "p2.ds"), "--tokenizer", str(ASSETS)])


def test_a_killed_runs_temporary_directory_is_removed_and_a_concurrent_run_is_not_overwritten(tmp_path, monkeypatch):
    src, out = tmp_path / "c.jsonl", tmp_path / "ds"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(10)))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ds.tmp-{dead.pid}"  # what a run killed mid-way leaves
    stale.mkdir()
    (stale / "tokens-00000.bin").write_bytes(b"x" * 10)
    pretokenize.main([str(src), str(out), "--tokenizer", str(ASSETS), "--no-progress"])
    assert not stale.exists() and (out / "manifest.json").is_file()

    other = tmp_path / "other"
    real_write = pretokenize._write

    def meanwhile(tmp, *args, **kwargs):
        other.mkdir()
        (other / "theirs.txt").write_text("written by the other run")
        return real_write(tmp, *args, **kwargs)

    monkeypatch.setattr(pretokenize, "_write", meanwhile)
    with pytest.raises(ZooError, match="written by another run while this one tokenized"):
        pretokenize.main([str(src), str(other), "--tokenizer", str(ASSETS), "--no-progress"])
    assert [p.name for p in other.iterdir()] == ["theirs.txt"]
    assert not list(tmp_path.glob(".other.tmp-*"))


def test_pretrain_data_refuses_a_jsonl_linked_from_outside_its_directory(tmp_path):
    from recipes.data.jsonl import list_files

    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps({"text": "not yours"}) + "\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "yours"}) + "\n")
    assert list_files(data) == [data / "a.jsonl"]
    (data / "b.jsonl").symlink_to(outside)
    with pytest.raises(ZooError, match="b.jsonl: resolves to .*secret.jsonl, which is not a regular file inside"):
        list_files(data)


def test_summary_in_words(tmp_path, capsys):
    """One file is "1 file", and a few hundred bytes are bytes, not "0.0 MB"."""
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"text": "a short document"}) + "\n")
    pretokenize.main([str(src), str(tmp_path / "ds"), "--tokenizer", str(ASSETS), "--no-progress"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    size = src.stat().st_size
    assert "1 document, " in line and f"from 1 file of {size} bytes in " in line, line
    assert "0.0 MB" not in line and "(s)" not in line
    assert pretokenize.in_bytes(2_500_000) == "2.5 MB" and pretokenize.in_bytes(1) == "1 byte"
    assert pretokenize.plural(1234, "token") == "1,234 tokens"
