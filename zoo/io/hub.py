"""Hugging Face hub ids as checkpoint directories: `Qwen/Qwen3-0.6B` is the snapshot huggingface_hub left in its local
cache (`hf download Qwen/Qwen3-0.6B`, or transformers' own downloads), found without importing huggingface_hub; it
is downloaded only when asked (`download=True`, `--download`), through huggingface_hub, and never when
HF_HUB_OFFLINE is set.

The cache is laid out as huggingface_hub writes it: `CACHE/models--ORG--NAME/refs/main` holds the commit of branch
main, `snapshots/COMMIT/` the files, each a relative link into `blobs/` (which `zoo.io.paths.inside` accepts in
exactly that shape).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zoo.errors import ZooError

# a repository id as the hub accepts them: ORG/NAME of letters, digits, - _ . (no leading punctuation, no .. or --)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES
# what a download fetches: weights, configs and tokenizers (no pickles, no code, no other formats)
ALLOW = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses: HF_HUB_CACHE, else (legacy) HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, where
    HF_HOME defaults to $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface (huggingface_hub.constants)."""
    home = os.getenv("HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                             "huggingface"))
    home = os.path.expandvars(os.path.expanduser(home))
    hub = os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value, as huggingface_hub reads them."""
    return (os.getenv("HF_HUB_OFFLINE") or os.getenv("TRANSFORMERS_OFFLINE") or "").upper() in TRUE


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a hub repository id ORG/NAME (a relative path may be spelled alike)."""
    return HUB_ID.fullmatch(name) is not None and ".." not in name and "--" not in name


def repo_dir(repo_id: str) -> Path:
    """Where the cache keeps `repo_id`: CACHE/models--ORG--NAME."""
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` at `revision` in the local cache, or None. As huggingface_hub's
    try_to_load_from_cache resolves it: a name in refs/ (a branch or tag; main by default) holds its commit, else a
    commit hash names its snapshot directly."""
    repo = repo_dir(repo_id)
    rev = revision or "main"
    if not rev or ".." in Path(rev).parts or Path(rev).is_absolute() or "\0" in rev:
        raise ZooError(f"revision {rev!r} is not a branch, tag or commit name")
    commit, ref = rev, repo / "refs" / rev
    if ref.is_file():
        with ref.open("rb") as f:  # a 40-digit hash: more is damage (and a huge file is never read whole)
            commit = f.read(100).decode(errors="replace").strip()
        if not COMMIT.fullmatch(commit):
            raise ZooError(f"{ref}: expected a commit hash (40 hex digits), got {commit[:60]!r}")
    elif not COMMIT.fullmatch(rev):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def fetch(repo_id: str, revision: str | None = None) -> Path:
    """`repo_id` fetched into the cache through huggingface_hub (safetensors, configs, tokenizer files only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ZooError(f"downloading {repo_id} needs huggingface_hub (pip install huggingface_hub), or download it "
                       f"yourself: hf download {repo_id}") from None
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), allow_patterns=ALLOW))
    except Exception as e:  # huggingface_hub's errors (no such repository, gated, network) have no common base
        raise ZooError(f"downloading {repo_id}{f' at {revision}' if revision else ''} failed: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def missing(repo_id: str, revision: str | None = None, flag: str = "download=True") -> str:
    """What to run when `repo_id` is not in the cache (one clause, for a ZooError)."""
    at = f" --revision {revision}" if revision else ""
    where = f"{repo_dir(repo_id)}{f' at {revision}' if revision else ''}"
    from zoo.models.presets import PRESETS

    how = "HF_HUB_OFFLINE is set, so zoo does not download" if offline() else f"or pass {flag} to download it"
    preset = next((n for n, p in PRESETS.items() if p.hf_source and p.hf_source.lower() == repo_id.lower()), None)
    also = f"; it is the source of preset {preset!r}" if preset else ""
    return (f"{repo_id} is not in the Hugging Face cache ({where}): run `hf download {repo_id}{at}` "
            f"(HF_HUB_CACHE / HF_HOME choose the cache), {how}{also}")


def resolve(name_or_path: str | os.PathLike[str], revision: str | None = None, download: bool = False,
            flag: str = "download=True", what: str = "the model") -> Path:
    """The checkpoint directory `name_or_path` names: itself when it is a directory; for a hub id ORG/NAME, its
    snapshot in the local cache (`revision`: a branch, tag or commit; default main), downloaded first when asked
    (`download`) and allowed (huggingface_hub installed, not HF_HUB_OFFLINE). Else a ZooError saying what to run;
    `flag` is how the caller asks for a download (`--download` on a command line), `what` how it names the model
    (`--model`: said of an adapter directory, which is not one)."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        if revision is not None:
            raise ZooError(f"{name} is a directory: a revision ({revision}) applies to a Hugging Face hub id only")
        path = Path(name)
    elif not is_hub_id(name):
        raise ZooError(f"{name}: no such directory (expected a checkpoint directory or a Hugging Face hub id ORG/NAME)")
    else:
        found = cached(name, revision)
        if found is None and not (download and not offline()):
            raise ZooError(missing(name, revision, flag))
        path = found or fetch(name, revision)
    lora = adapter(path, what)  # a directory or a hub repository of a PEFT adapter
    if lora is not None:
        raise lora
    return path


def adapter(directory: Path, flag: str = "the model") -> ZooError | None:
    """A ZooError when `directory` is a LoRA adapter (adapter_config.json, no config.json) rather than a model: what
    it is and what to pass instead (`flag`: "--model"); else None."""
    if not (directory / "adapter_config.json").is_file() or (directory / "config.json").exists():
        return None
    from zoo.io.paths import inside, json_object

    base = json_object(inside(directory, "adapter_config.json", "adapter config")).get("base_model_name_or_path")
    merged = directory.parent / "model"
    also = (f"; the run that wrote it also wrote the merged model {merged}, which zoo loads"
            if (merged / "config.json").is_file() else "")
    return ZooError(f"{directory} is a LoRA adapter (adapter_config.json, no config.json), not a model: pass its base "
                    f"model{f' ({base})' if isinstance(base, str) and base else ''} as {flag}{also}; transformers "
                    "with PEFT loads the adapter over its base (PeftModel.from_pretrained)")
