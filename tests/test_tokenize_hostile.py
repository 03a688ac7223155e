"""Token datasets under hostile input: a document too long to tokenize, a .parquet that is not Parquet, a tokenizer
whose ids pass its vocabulary size, a hand-edited manifest.json or documents.npy, odd JSONL lines. Each fails in one
line (a ZooError naming the file and what was expected), in recipes.pretokenize and in the JSONL path alike."""

import json
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_recipes import CPU, ROOT, TINY, env

from recipes import pretokenize, pretrain
from recipes.data import PretrainData, TokenData, jsonl
from recipes.data.tokenizer_choice import ASSETS, Tokenizer
from recipes.engine.command import cli
from zoo.errors import ZooError

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1) for i in range(24)]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def make(src, out, tokenizer=ASSETS, *extra):
    return pretokenize.main([str(src), str(out), "--tokenizer", str(tokenizer), "--no-progress", *extra])


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ASSETS)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return make(write_jsonl(root / "c.jsonl", TEXTS), root / "ds", ASSETS, "--chunk-mb", "0.0005")


@pytest.fixture
def copy(dataset, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(dataset, out)
    return out


# ---- 1. a document too long to tokenize ----


def test_a_line_past_the_limit_is_refused_in_both_paths_without_reading_it_whole(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 1000)
    ok = json.dumps({"text": "x" * (1000 - 12)}) + "\n"  # exactly 1,000 bytes before its newline: allowed
    assert len(ok) == 1001
    src = tmp_path / "a.jsonl"
    src.write_text(ok + json.dumps({"text": "y " * 3000}) + "\n" + ok)
    pattern = r"a\.jsonl:2: expected a line \(one document\) of at most 1,000 bytes, got a longer one"
    with pytest.raises(ZooError, match=pattern) as e:
        make(src, tmp_path / "o")
    one_line(e)
    assert not (tmp_path / "o").exists()
    with pytest.raises(ZooError, match=pattern):
        PretrainData(str(src), tok, 8, 0)
    # the reader asks for no more than the limit (and one byte) of any line
    asked = []
    real = jsonl.read_line

    def spy(fh, f, n):
        class Limited:
            def readline(self, limit=-1):
                asked.append(limit)
                return fh.readline(limit)
        return real(Limited(), f, n)

    monkeypatch.setattr(jsonl, "read_line", spy)
    with pytest.raises(ZooError, match=pattern):
        make(src, tmp_path / "o")
    assert asked and all(0 < x <= 1001 for x in asked)
    # at the end of a file without a newline, the same bound
    src.write_text(ok + ok.rstrip("\n"))
    assert len(PretrainData(str(src), tok, 8, 0).stats) and make(src, tmp_path / "fine").is_dir()
    src.write_text(ok + json.dumps({"text": "x" * (1001 - 12)}))
    with pytest.raises(ZooError, match=r"a\.jsonl:2: expected a line"):
        PretrainData(str(src), tok, 8, 0)


def test_the_cli_refuses_a_line_past_the_real_limit_in_one_line(tmp_path):
    src = tmp_path / "big.jsonl"
    with src.open("w") as fh:
        fh.write(json.dumps({"text": "first"}) + "\n")
        fh.write(json.dumps({"text": "word " * ((jsonl.MAX_LINE_BYTES + (1 << 20)) // 5)}) + "\n")
    run = subprocess.run([sys.executable, "-m", "recipes.pretokenize", str(src), str(tmp_path / "o"), "--tokenizer",
                          str(ASSETS), "--no-progress"], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr[-2000:]
    assert f"big.jsonl:2: expected a line (one document) of at most {jsonl.MAX_LINE_BYTES:,} bytes" in run.stderr


# ---- 2. a .parquet that is not Parquet ----


def test_a_parquet_source_without_pyarrow_names_the_file(tmp_path):
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow installed: the message that it is needed never shows")
    except ImportError:
        pass
    (tmp_path / "p").mkdir()
    write_jsonl(tmp_path / "p" / "a.parquet", ["json, not parquet"])
    with pytest.raises(ZooError, match=r"a\.parquet: reading Parquet needs pyarrow \(pip install pyarrow\)") as e:
        make(tmp_path / "p", tmp_path / "o")
    one_line(e)


@pytest.mark.parametrize("content", [b'{"text": "json, not parquet"}\n', b"", b"PAR1" + b"\0" * 64 + b"PAR1"])
def test_a_parquet_file_that_is_not_parquet(tmp_path, content):
    pytest.importorskip("pyarrow", reason="pyarrow not installed")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "a.parquet").write_bytes(content)
    with pytest.raises(ZooError, match=r"a\.parquet: expected a Parquet file, got one pyarrow cannot read") as e:
        make(tmp_path / "p", tmp_path / "o")
    one_line(e)


def test_a_damaged_parquet_file_and_a_row_past_the_limit(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed")
    (tmp_path / "p").mkdir()
    f = tmp_path / "p" / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 60 for i in range(200)]}), f, compression="none",
                   row_group_size=50)
    good = f.read_bytes()
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 300)
    with pytest.raises(ZooError, match=r"a\.parquet: row 1: expected a document of at most 300 bytes"):
        make(tmp_path / "p", tmp_path / "o")
    monkeypatch.undo()
    data = bytearray(good)
    data[200:3000] = b"\xff" * 2800  # pages of the first row group: the footer still reads
    f.write_bytes(bytes(data))
    with pytest.raises(ZooError, match=r"a\.parquet: expected a Parquet file, got one pyarrow cannot read") as e:
        make(tmp_path / "p", tmp_path / "o")
    one_line(e)


# ---- 3. token ids past the vocabulary size ----


@pytest.fixture(scope="module")
def wide(tmp_path_factory, tok):
    """The bundled tokenizer with the id of " over" moved to 70,000: its vocab_size is still 2,048."""
    root = tmp_path_factory.mktemp("wide")
    shutil.copytree(ASSETS, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.jsonl"))
    config = json.loads((root / "tokenizer.json").read_text())
    over = tok.encode(" over", add_special_tokens=False)
    assert len(over) == 1
    token = next(t for t, i in config["model"]["vocab"].items() if i == over[0])
    config["model"]["vocab"][token] = 70_000
    (root / "tokenizer.json").write_text(json.dumps(config))
    wide = Tokenizer(root)
    assert wide.vocab_size == 2048 and wide.id_bound == 70_001
    assert wide.encode(" over", add_special_tokens=False) == [70_000]
    return wide


def test_ids_past_the_vocab_size_are_kept_not_wrapped(tmp_path, wide):
    ds = make(write_jsonl(tmp_path / "c.jsonl", TEXTS), tmp_path / "ds", wide.dir)
    m = json.loads((ds / "manifest.json").read_text())
    assert m["dtype"] == "uint32"
    stream = np.concatenate([np.fromfile(ds / s["file"], dtype=np.uint32) for s in m["shards"]])
    want = [i for t in TEXTS for i in [wide.bos_id, *wide.encode(t, add_special_tokens=False), wide.eos_id]]
    assert 70_000 in want and stream.tolist() == want


def test_an_id_that_does_not_fit_the_dtype_is_refused_not_wrapped(tmp_path, wide):
    src = write_jsonl(tmp_path / "a.jsonl", ["no such token here", "the fox jumps over"])
    job = (src, (0, src.stat().st_size, 1), tmp_path / "tokens-00000.bin", "uint16", 0)
    with pytest.raises(ZooError, match=r"a\.jsonl:2: expected token ids that fit uint16 \(at most 65535\), got "
                                       r"70000 from the tokenizer .*tokenizer\.json \(vocab_size 2048\)") as e:
        pretokenize.tokenize_chunk(job, wide)
    one_line(e)


def test_a_dataset_whose_ids_were_wrapped_is_refused(tmp_path, wide):
    ds = make(write_jsonl(tmp_path / "c.jsonl", TEXTS), tmp_path / "ds", wide.dir)
    m = json.loads((ds / "manifest.json").read_text())
    for s in m["shards"]:  # what recipes.pretokenize wrote when it picked uint16 from vocab_size
        np.fromfile(ds / s["file"], dtype=np.uint32).astype(np.uint16).tofile(ds / s["file"])
    (ds / "manifest.json").write_text(json.dumps({**m, "dtype": "uint16"}))
    with pytest.raises(ZooError, match=r"expected token ids up to 70000 .*got a dataset of uint16, which cannot "
                                       r"hold them") as e:
        TokenData(ds, wide, 16, 0)
    one_line(e)


def test_a_shard_holding_an_id_past_the_tokenizer_fails_its_pack(copy, tok):
    shard = copy / json.loads((copy / "manifest.json").read_text())["shards"][1]["file"]
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[1] = 60_000
    ids.tofile(shard)
    data = TokenData(copy, tok, 16, 0)
    with pytest.raises(ZooError, match=r"expected token ids below 2048 \(the tokenizer's\), got 60000 in tokens "
                                       r".*the dataset is damaged") as e:
        for g in range(len(data)):
            data.pack(g)
    one_line(e)


# ---- 4. a hand-edited manifest.json ----


def _edit(m, path, value):
    *keys, last = path
    for k in keys:
        m = m[k]
    if value is KeyError:
        del m[last]
    else:
        m[last] = value


@pytest.mark.parametrize("path, value, match", [
    (["tokens"], KeyError, r"tokens must be an integer of at least 0, got nothing \(no such key\)"),
    (["tokens"], "12", r'tokens must be an integer of at least 0, got "12"'),
    (["documents"], -1, r"documents must be an integer of at least 0, got -1"),
    (["documents"], True, r"documents must be an integer of at least 0, got true"),
    (["dtype"], "float64", r'dtype must be one of uint16, uint32, got "float64"'),
    (["dtype"], "int8", r'dtype must be one of uint16, uint32, got "int8"'),
    (["dtype"], "object", r'dtype must be one of uint16, uint32, got "object"'),
    (["dtype"], KeyError, r"dtype must be one of uint16, uint32, got nothing"),
    (["shards"], {}, r"shards must be a list, got \{\}"),
    (["shards", 0], "tokens-00000.bin", r'shards\[0\] must be an object \{"file": ..., "tokens": ...\}, got "tok'),
    (["shards", 0, "file"], 5, r"shards\[0\]\.file must be a file name, got 5"),
    (["shards", 1, "tokens"], -3, r"shards\[1\]\.tokens must be an integer of at least 1, got -3"),
    (["shards", 1, "tokens"], 0, r"shards\[1\]\.tokens must be an integer of at least 1, got 0"),
    (["shards", 1, "tokens"], "7", r'shards\[1\]\.tokens must be an integer of at least 1, got "7"'),
    (["tokenizer"], "abc", r'tokenizer must be an object \{"sha256": "...", ...\}, got "abc"'),
    (["tokenizer", "sha256"], KeyError, r"tokenizer must be an object"),
    (["sources"], "c.jsonl", r'sources must be a list of objects, got "c.jsonl"'),
    (["sources"], [1], r"sources must be a list of objects, got \[1\]"),
])
def test_a_hand_edited_manifest_names_the_field(copy, tok, path, value, match):
    m = json.loads((copy / "manifest.json").read_text())
    _edit(m, path, value)
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match=r"manifest\.json: " + match + r".*re-create it with python -m "
                                       r"recipes\.pretokenize") as e:
        TokenData(copy, tok, 16, 0)
    one_line(e)


def test_manifest_tokens_must_be_what_the_shards_hold(copy, tok):
    m = json.loads((copy / "manifest.json").read_text())
    m["tokens"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match=rf"tokens must be what the shards hold \({m['tokens'] - 1}\), got "
                                       rf"{m['tokens']}"):
        TokenData(copy, tok, 16, 0)
    (copy / "manifest.json").write_text('{"format": "zoo-tokens", "version": 1, "tokens": 1' + "0" * 5000 + "}")
    with pytest.raises(ZooError, match=r"manifest\.json: not a valid manifest \(Exceeds the limit"):
        TokenData(copy, tok, 16, 0)


def test_pretrain_on_a_damaged_manifest_exits_2_with_one_line(copy, tmp_path, capsys):
    m = json.loads((copy / "manifest.json").read_text())
    m["tokenizer"] = "abc"  # was: TypeError: string indices must be integers
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit) as e:
        cli(lambda: pretrain.main(["--data", str(copy), "--out", str(tmp_path / "run"), *TINY, *CPU]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and 'tokenizer must be an object {"sha256"' in err


def test_tokenize_over_a_damaged_dataset_asks_for_force_then_replaces_it(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    out = make(src, tmp_path / "ds")
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "tokens": "12"}))
    with pytest.raises(ZooError, match=r'tokens must be an integer of at least 0, got "12".*pass --force to replace '
                                       r"it") as e:
        make(src, out)
    one_line(e)
    make(src, out, ASSETS, "--force")
    assert json.loads((out / "manifest.json").read_text()) == m
    # a manifest.json of another program's is still never replaced
    (out / "manifest.json").write_text(json.dumps({"format": "theirs", "tokens": "12"}))
    with pytest.raises(ZooError, match="holds other files"):
        make(src, out, ASSETS, "--force")


# ---- 5. a hand-edited documents.npy ----


def _starts(ds):
    return np.load(ds / "documents.npy")


def _float(ds):
    np.save(ds / "documents.npy", _starts(ds).astype(np.float64))


def _two_d(ds):
    np.save(ds / "documents.npy", _starts(ds)[None])


def _object(ds):
    np.save(ds / "documents.npy", _starts(ds).astype(object), allow_pickle=True)


def _first(ds):
    s = _starts(ds)
    s[0] = 1
    np.save(ds / "documents.npy", s)


def _last(ds):
    s = _starts(ds)
    s[-1] -= 1
    np.save(ds / "documents.npy", s)


def _truncated(ds):
    raw = (ds / "documents.npy").read_bytes()
    (ds / "documents.npy").write_bytes(raw[:-12])


def _header(ds):
    (ds / "documents.npy").write_bytes((ds / "documents.npy").read_bytes()[:40])


def _npz(ds):
    starts = _starts(ds)
    with open(ds / "documents.npy", "wb") as fh:
        np.savez(fh, starts=starts)


@pytest.mark.parametrize("damage, match", [
    (_float, r"expected \d+ integers \(the manifest's documents \+ 1\), got float64 \[\d+\]"),
    (_two_d, r"expected (\d+) integers \(the manifest's documents \+ 1\), got int64 \[1, \1\]"),
    (_object, r"expected a \.npy array of document starts, got a file numpy cannot map \(Array can't be "
              r"memory-mapped"),
    (_first, r"expected document starts from 0 up to the manifest's \d+ tokens, got 1 \.\. "),
    (_last, r"expected document starts from 0 up to the manifest's (\d+) tokens, got 0 \.\. (?!\1\b)\d+"),
    (_truncated, r"expected a \.npy array of document starts, got a file numpy cannot map \(mmap length"),
    (_header, r"expected a \.npy array of document starts, got a file numpy cannot map \(EOF"),
    (_npz, r"expected a \.npy array of document starts \(a file starting b'\\x93NUMPY'\), got one starting "
           r"b'PK\\x03\\x04"),
])
def test_a_hand_edited_document_index(copy, tok, damage, match):
    damage(copy)
    with pytest.raises(ZooError, match=r"documents\.npy: " + match + r".*the dataset is damaged") as e:
        TokenData(copy, tok, 16, 0)
    one_line(e)


class _Touch:
    """Unpickling this creates a file: the proof that a document index is never unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_pickled_document_index_is_refused_unloaded(copy, tok, tmp_path):
    marker = tmp_path / "unpickled"
    (copy / "documents.npy").write_bytes(pickle.dumps([_Touch(marker), 0, 1, 2]))
    with pytest.raises(ZooError, match=r"documents\.npy: expected a \.npy array of document starts \(a file "
                                       r"starting b'\\x93NUMPY'\), got one starting b'\\x80"):
        TokenData(copy, tok, 16, 0)
    assert not marker.exists()


def test_a_document_index_that_does_not_increase_fails_the_pack_that_reads_it(copy, tok):
    s = _starts(copy)
    s[5], s[6] = s[6], s[5]
    np.save(copy / "documents.npy", s)
    data = TokenData(copy, tok, 16, 0)
    with pytest.raises(ZooError, match=r"documents\.npy: expected increasing document starts, got \[") as e:
        for i in range(len(data)):
            data.in_order(i)
    one_line(e)


# ---- 6. odd JSONL lines, the same in both paths ----


@pytest.mark.parametrize("raw, match", [
    (b'{"text": 5}\n', r'c\.jsonl:2: expected \{"text": "..."\}, got \{"text": 5\}'),
    (b'{"text": null}\n', r'c\.jsonl:2: expected \{"text": "..."\}, got \{"text": null\}'),
    (b'{"text": ["a"]}\n', r'c\.jsonl:2: expected \{"text": "..."\}, got \{"text": <an array>\}'),
    (b'{"text": "a\x00b"}\n', r"c\.jsonl:2:12: malformed JSON line \(unescaped control character '\\x00' in a "
                              r"string at column 12\)"),
    (b'{"text": "x", "n": 1' + b"0" * 5000 + b"}\n",
     r"c\.jsonl:2: expected integers of at most \d+ digits, got a longer one"),
])
def test_odd_lines_name_file_line_and_what_came(tmp_path, tok, raw, match):
    src = tmp_path / "c.jsonl"
    src.write_bytes(b'{"text": "fine"}\n' + raw)
    with pytest.raises(ZooError, match=match) as e:
        make(src, tmp_path / "o")
    one_line(e)
    with pytest.raises(ZooError, match=match):
        PretrainData(str(src), tok, 4, 0)


def test_a_bom_at_the_start_of_a_file_is_skipped_in_both_paths(tmp_path, tok):
    plain = write_jsonl(tmp_path / "plain.jsonl", TEXTS)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    a, b = make(plain, tmp_path / "a"), make(bom, tmp_path / "b")
    assert [p.read_bytes() for p in sorted(a.glob("tokens-*"))] == [p.read_bytes() for p in sorted(b.glob("tokens-*"))]
    assert PretrainData(str(bom), tok, 16, 0).fingerprint == PretrainData(str(plain), tok, 16, 0).fingerprint
    # only at the start: a BOM inside a file (two files concatenated) is no JSON
    bom.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + plain.read_bytes())
    with pytest.raises(ZooError, match=rf"bom\.jsonl:{len(TEXTS) + 1}:1: malformed JSON line"):
        PretrainData(str(bom), tok, 16, 0)


def test_pretrain_refuses_a_tokenizer_whose_ids_pass_the_models_vocabulary_before_reading_data(tmp_path, wide):
    """Its vocab_size (2,048) fits the debug model; its ids (up to 70,000) do not: refused at start, by id, not at
    the first step's embedding lookup."""
    with pytest.raises(ZooError, match="gives ids up to 70000 but the model's vocabulary is 2048"):
        pretrain.main(["--tokenizer", str(wide.dir), "--data", str(tmp_path / "never-read.jsonl"),
                       "--out", str(tmp_path / "o"), "--device", "cpu", "--steps", "1"])
