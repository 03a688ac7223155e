"""Hugging Face hub ids (issue 43): the local cache as huggingface_hub lays it out (refs/, snapshots/REV/ linking into
blobs/, and huggingface_hub 2's shared store), built here, offline; zoo.load, the recipes' --model, zoo.generate and
the converter read a cached hub id; a link out of that shape stays refused."""

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

import zoo
from convert.common import run_cli
from convert.hf_to_zoo import main as hf_to_zoo_main
from convert.zoo_to_hf import zoo_to_hf
from recipes import pretrain
from recipes.data.tokenizer_choice import ASSETS
from recipes.engine.build import resolve_model
from recipes.engine.sections import ModelSection
from zoo.errors import ZooError
from zoo.generate.cli import main as generate_main
from zoo.io import hub
from zoo.io.safetensors import SafetensorsDir

MAIN, OLD = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The debug preset with random weights, in Hugging Face's layout, with the bundled tokenizer."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hub")
    zoo.save(zoo.load("debug"), root / "zoo", tokenizer_from=ASSETS)
    return zoo_to_hf(root / "zoo", root / "hf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache of this test's own: HF_HUB_CACHE, never the user's ~/.cache."""
    path = tmp_path / "hf-cache"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    return path


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str = MAIN, ref: str | None = "main",
               shared: bool = False) -> Path:
    """`source`'s files as huggingface_hub caches them: blobs/ETAG, snapshots/COMMIT/NAME -> ../../blobs/ETAG
    (relative links), refs/REF holding the commit; with `shared`, each blob a link into the cache-wide store
    CACHE/blobs/HH/HASH (huggingface_hub 2, Xet files). Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        digest = hashlib.sha256(data + commit.encode()).hexdigest()
        blob = repo / "blobs" / digest
        if shared:
            store = cache / "blobs" / digest[:2] / digest
            store.parent.mkdir(parents=True, exist_ok=True)
            (cache / "blobs" / ".huggingface-shared-blobs").write_text("1\n")
            store.write_bytes(data)
            blob.symlink_to(os.path.relpath(store, blob.parent))
        else:
            blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# ---- where the cache is ----


def test_the_cache_is_found_as_huggingface_hub_finds_it(monkeypatch, tmp_path):
    constants = pytest.importorskip("huggingface_hub.constants")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    import importlib

    cases = [{}, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, {"HF_HOME": str(tmp_path / "home")},
             {"HF_HOME": str(tmp_path / "home"), "HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy")},
             {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy"), "HF_HUB_CACHE": str(tmp_path / "new")},
             {"HF_HOME": "~/hf"}]
    try:
        for env in cases:
            with monkeypatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                importlib.reload(constants)
                assert hub.cache_dir() == Path(constants.HF_HUB_CACHE), env
    finally:
        importlib.reload(constants)  # as the process's environment has it


# ---- zoo.load ----


def test_a_cached_hub_id_loads_from_its_snapshot_at_main_or_a_revision(cache, checkpoint):
    cache_repo(cache, "zoo-test/tiny", checkpoint)
    want = zoo.load(checkpoint)
    assert same_weights(zoo.load("zoo-test/tiny"), want)
    # another commit: by its hash, and by a tag naming it; main still the first
    torch.manual_seed(1)
    other = cache.parent / "other"
    zoo_to_hf(zoo.save(zoo.load("debug"), cache.parent / "other-zoo", tokenizer_from=ASSETS), other)
    cache_repo(cache, "zoo-test/tiny", other, commit=OLD, ref="v1")
    old = zoo.load(other)
    assert not same_weights(old, want)
    assert same_weights(zoo.load("zoo-test/tiny", revision=OLD), old)
    assert same_weights(zoo.load("zoo-test/tiny", revision="v1"), old)
    assert same_weights(zoo.load("zoo-test/tiny"), want)
    with pytest.raises(ZooError, match=r"zoo-test/tiny is not in the Hugging Face cache \(.* at v2\): run "
                                       r"`hf download zoo-test/tiny --revision v2`"):
        zoo.load("zoo-test/tiny", revision="v2")
    with pytest.raises(ZooError, match="revision '../x' is not a branch, tag or commit name"):
        zoo.load("zoo-test/tiny", revision="../x")
    (cache / "models--zoo-test--tiny" / "refs" / "main").write_text("not a commit\n" * 1000)
    with pytest.raises(ZooError, match=r"refs/main: expected a commit hash \(40 hex digits\), got 'not a commit"):
        zoo.load("zoo-test/tiny")


def test_the_shared_blob_store_of_huggingface_hub_2_is_read(cache, checkpoint):
    cache_repo(cache, "zoo-test/tiny", checkpoint, shared=True)
    assert same_weights(zoo.load("zoo-test/tiny"), zoo.load(checkpoint))
    (cache / "blobs" / ".huggingface-shared-blobs").unlink()  # no marker: not huggingface_hub's store
    with pytest.raises(ZooError, match="resolves to .*, outside the checkpoint directory"):
        zoo.load("zoo-test/tiny")


def test_an_uncached_hub_id_says_what_to_run_and_downloads_only_when_asked(cache, monkeypatch):
    with pytest.raises(ZooError) as e:
        zoo.load("Qwen/Qwen3-0.6B")
    assert str(e.value) == (f"Qwen/Qwen3-0.6B is not in the Hugging Face cache ({cache / 'models--Qwen--Qwen3-0.6B'})"
                            ": run `hf download Qwen/Qwen3-0.6B` (HF_HUB_CACHE / HF_HOME choose the cache), or pass "
                            "download=True to download it; it is the source of preset 'qwen3-0.6b'")
    asked = []

    def snapshot_download(repo_id, revision, cache_dir, allow_patterns):
        asked.append((repo_id, revision, cache_dir, allow_patterns))
        raise OSError("no network here")

    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ZooError, match="HF_HUB_OFFLINE is set, so zoo does not download"):
        zoo.load("Qwen/Qwen3-0.6B", download=True)
    assert asked == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ZooError, match="downloading Qwen/Qwen3-0.6B failed: OSError: no network here"):
        zoo.load("Qwen/Qwen3-0.6B", download=True)
    (repo_id, revision, cache_dir, patterns), = asked
    assert (repo_id, revision, cache_dir) == ("Qwen/Qwen3-0.6B", None, cache)
    assert "*.safetensors" in patterns and not any(p.endswith((".bin", ".py", ".pt", ".pth", "*")) for p in patterns)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(ZooError, match=r"downloading Qwen/Qwen3-0\.6B needs huggingface_hub \(pip install "
                                       r"huggingface_hub\), or download it yourself: hf download Qwen/Qwen3-0\.6B"):
        zoo.load("Qwen/Qwen3-0.6B", download=True)


def test_a_download_lands_in_the_cache_and_is_read_from_there(cache, checkpoint, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def snapshot_download(repo_id, revision, cache_dir, allow_patterns):  # what huggingface_hub leaves behind
        return str(cache_repo(cache_dir, repo_id, checkpoint, commit=revision or MAIN))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert same_weights(zoo.load("zoo-test/fetched", download=True), zoo.load(checkpoint))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", None)  # cached now: no second download
    assert same_weights(zoo.load("zoo-test/fetched", download=True), zoo.load(checkpoint))


# ---- the link check: exactly the cache's shape ----


def test_links_out_of_a_snapshot_are_refused_unless_into_its_own_blobs(cache, checkpoint, tmp_path):
    snapshot = cache_repo(cache, "zoo-test/tiny", checkpoint)
    cache_repo(cache, "zoo-test/other", checkpoint)
    weights = snapshot / "model.safetensors"
    assert SafetensorsDir(snapshot).names()  # its own blobs: read
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(weights.read_bytes())
    other_blob = next((cache / "models--zoo-test--other" / "blobs").iterdir())
    for target in (elsewhere, os.path.relpath(other_blob, snapshot)):  # anywhere else; another repository's blobs
        weights.unlink()
        weights.symlink_to(target)
        with pytest.raises(ZooError, match="model.safetensors: weights file resolves to .*, outside the checkpoint "
                                           "directory"):
            SafetensorsDir(snapshot).names()
    # the same links from a directory that is no snapshot: refused as before
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(next((cache / "models--zoo-test--tiny" / "blobs").iterdir()))
    with pytest.raises(ZooError, match="outside the checkpoint directory"):
        SafetensorsDir(plain).names()


def test_a_blob_that_links_on_out_of_the_cache_is_refused(cache, checkpoint, tmp_path):
    snapshot = cache_repo(cache, "zoo-test/tiny", checkpoint)
    blob = (snapshot / "model.safetensors").resolve()
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(blob.read_bytes())
    blob.unlink()
    blob.symlink_to(outside)  # blobs/ETAG -> anywhere: not huggingface_hub's shared store
    with pytest.raises(ZooError, match="outside the checkpoint directory"):
        SafetensorsDir(snapshot).names()


# ---- the commands ----


def test_the_recipes_model_takes_a_cached_hub_id(cache, checkpoint, tmp_path):
    snapshot = cache_repo(cache, "zoo-test/tiny", checkpoint)
    assert resolve_model(ModelSection(name="zoo-test/tiny")).name == str(snapshot)
    assert resolve_model(ModelSection(name="DEBUG")).name == "debug"
    losses = pretrain.main(["--model", "zoo-test/tiny", "--steps", "1", "--warmup", "1", "--seq-len", "64",
                            "--batch-tokens", "128", "--no-progress", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert len(losses) == 1
    with pytest.raises(ZooError, match=r"--model zoo-test/nothing: no such directory; zoo-test/nothing is not in the "
                                       r"Hugging Face cache .*or pass --download to download it"):
        resolve_model(ModelSection(name="zoo-test/nothing"))
    with pytest.raises(ZooError, match="is a directory: a revision"):
        resolve_model(ModelSection(name=str(checkpoint), revision="main"))


def test_generate_and_the_converter_take_a_cached_hub_id(cache, checkpoint, tmp_path, capsys):
    cache_repo(cache, "zoo-test/tiny", checkpoint)
    assert generate_main(["zoo-test/tiny", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("hi")
    assert generate_main(["zoo-test/none", "--prompt", "hi"]) == 2
    assert "zoo-test/none is not in the Hugging Face cache" in capsys.readouterr().err
    assert run_cli(hf_to_zoo_main, ["zoo-test/tiny", str(tmp_path / "converted"), "--quiet"]) == 0
    assert same_weights(zoo.load(tmp_path / "converted"), zoo.load(checkpoint))
    assert (tmp_path / "converted" / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert not (tmp_path / "converted" / "tokenizer.json").is_symlink()
    assert run_cli(hf_to_zoo_main, ["zoo-test/tiny", str(tmp_path / "c2"), "--revision", "v9", "--quiet"]) == 2
    assert "run `hf download zoo-test/tiny --revision v9`" in capsys.readouterr().err
