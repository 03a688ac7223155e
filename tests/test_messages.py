"""Messages that point the right way: --help names the command a user types, a missing --model directory is said
to be missing (not an unknown preset), an --out that is a file is refused as such, `python -m zoo --help` is help."""

import subprocess
import sys
from pathlib import Path

import pytest

import zoo
from recipes import pretrain

ROOT = Path(__file__).resolve().parent.parent


RECIPES = ["pretrain", "sft", "llava", "dpo", "pretokenize"]
HELPS = [("-m", f"recipes.{recipe}", "--help") for recipe in RECIPES] + [("-m", "zoo", "--help")]
EARLY: dict[tuple[str, ...], subprocess.Popen[str]] = {}


def start(args: tuple[str, ...]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def start_early(items: list[pytest.Item]) -> None:
    """conftest calls this with this module's selected tests once the session's are collected: the --help commands
    (each a fresh interpreter importing torch) start now, beside the tests before them."""
    if any(getattr(item, "originalname", None) in ("test_help_names_the_command", "test_zoo_help_is_help")
           for item in items):
        EARLY.update({args: start(args) for args in HELPS})


def stop_early() -> None:
    while EARLY:
        proc = EARLY.popitem()[1]
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS`, as started early, or now."""
    proc = EARLY.pop(args, None) or start(args)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_names_the_command(recipe):
    done = run("-m", f"recipes.{recipe}", "--help")
    assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m recipes.{recipe} ")


def test_zoo_help_is_help():
    done = run("-m", "zoo", "--help")
    assert done.returncode == 0 and "python -m zoo presets" in done.stdout and not done.stderr


def test_presets_into_a_closed_pipe_is_no_traceback():
    listing = subprocess.Popen([sys.executable, "-m", "zoo", "presets"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, bufsize=0)
    assert listing.stdout is not None and listing.stderr is not None
    listing.stdout.readline()
    listing.stdout.close()  # as `| head -1` does
    err = listing.stderr.read()
    assert listing.wait(timeout=60) == 0 and "Traceback" not in err


def test_a_missing_model_directory_is_said_missing(tmp_path):
    with pytest.raises(zoo.ZooError, match="--model .*no/such/dir: no such directory"):
        pretrain.main(["--model", str(tmp_path / "no/such/dir"), "--out", str(tmp_path / "o")])
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(zoo.ZooError, match="--model .*model.safetensors: a file, not a directory"):
        pretrain.main(["--model", str(tmp_path / "model.safetensors"), "--out", str(tmp_path / "o")])


def test_a_hub_id_for_model_gets_the_download_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))  # an empty cache, not the user's
    with pytest.raises(zoo.ZooError, match="no such directory; meta-llama/Llama-3.2-1B is not in the Hugging Face "
                                           "cache .*hf download meta-llama/Llama-3.2-1B"):
        pretrain.main(["--model", "meta-llama/Llama-3.2-1B", "--out", str(tmp_path / "o")])


def test_an_out_that_is_a_file_is_refused_as_a_file(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("mine")
    with pytest.raises(zoo.ZooError, match="--out must be a directory .*not a file"):
        pretrain.main(["--out", str(file)])
    assert file.read_text() == "mine"
