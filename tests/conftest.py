"""Shared test setup: the golden fixtures (tests/fixtures), deterministic single-threaded CPU math."""

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from zoo.train.quant import import_torchao

# The test extra (pyproject.toml): the parity tests' references. Missing, the run stops at once in one line rather
# than turning the parity suite into skips; ZOO_TESTS_PARTIAL_EXTRA=1 (an image without some of them) lets the
# tests that need them skip instead.
TEST_EXTRA = {"transformers": "transformers", "peft": "peft", "trl": "trl", "torchao": "torchao", "mypy": "mypy",
              "protobuf": "google.protobuf"}


def pytest_configure(config):
    missing = [name for name, module in TEST_EXTRA.items() if not _importable(module)]
    if missing and os.environ.get("ZOO_TESTS_PARTIAL_EXTRA") != "1":
        raise pytest.UsageError(f"the test extra is missing {', '.join(missing)}: pip install -e '.[test]' "
                                "(or ZOO_TESTS_PARTIAL_EXTRA=1 to skip the tests that need them)")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


try:  # transformers imports torchao where installed (the test extra): imported first, it prints no load warnings
    import_torchao()
except ImportError:
    pass

# a copy of the upstream-computed goldens (source: ../shared/fixtures), so a fresh clone tests itself
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# The fixtures' goldens were computed single-threaded; multi-threaded CPU reductions move fp32 logits by ~1e-5.
torch.set_num_threads(1)


# the selected test modules that start their subprocesses early (`start_early`, ended by `stop_early`)
_EARLY: list = []


def _xdist_worker() -> bool:
    """True in a pytest-xdist worker (`-n 2`, the README's command)."""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist, whole test files go to a worker (a module's fixtures are made once; its multi-process
    tests stay one after another) in the order collected, longest subprocess work first (below)."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist the modules whose work is long subprocesses (those with `start_early`) are handed out
    first, so that no worker is left with one at the end while the other idles (files are dealt out in collection
    order; every worker sorts alike, as xdist requires)."""
    if _xdist_worker():
        items.sort(key=lambda item: not hasattr(getattr(item, "module", None), "start_early"))


def pytest_collection_finish(session):
    """Run serially, a selected test module whose work is subprocesses (the type checks, the docs' runnable blocks)
    starts them here, before the first test: they run on the core that the single-threaded tests leave idle (CI has
    2), and each test waits for its result when its turn comes. Under pytest-xdist both cores run tests and every
    worker collects every module, so each check starts when its test runs."""
    if session.config.option.collectonly or _xdist_worker():
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "start_early") and module not in _EARLY:
            _EARLY.append(module)
            module.start_early([i for i in session.items if getattr(i, "module", None) is module])


def pytest_sessionfinish(session):
    """End what a module started early and has not collected (a session stopped by -x or Ctrl-C)."""
    while _EARLY:
        _EARLY.pop().stop_early()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def prefixed(prefix: str) -> Callable[[str], str]:
    """torch.testing.assert_close's `msg`: its own message after `prefix`."""
    return lambda message: f"{prefix}: {message}"


def fixture_dir(name: str) -> Path:
    """A fixture: a Hugging Face checkpoint directory with golden.safetensors beside its weights. zoo, like
    transformers, reads model.safetensors or the shards of an index, so the goldens are never taken for weights;
    a test that needs the checkpoint alone copies it without them."""
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"golden fixture {path} is missing from the checkout")
    return path


def assert_matches_golden(model, packed, golden: dict, docs: list, where: str) -> None:
    """Every document's logits (atol 1e-4) and loss (1e-5) from ONE packed forward equal the upstream goldens."""
    import torch.nn.functional as F

    n_targets = [d.numel() - 1 for d in docs]
    mean_loss = sum(golden[f"doc{i}.loss"] * n for i, n in enumerate(n_targets)) / sum(n_targets)
    with torch.no_grad():
        logits = model(packed)
        loss = model.loss(packed)
    for i, doc in enumerate(docs):
        s, e = packed.cu_seqlens[i].item(), packed.cu_seqlens[i + 1].item()
        torch.testing.assert_close(logits[s:e], golden[f"doc{i}.logits"][0], atol=1e-4, rtol=1e-4,
                                   msg=prefixed(f"{where} doc {i}"))
        doc_loss = F.cross_entropy(logits[s : e - 1], doc[1:])
        assert abs(doc_loss.item() - golden[f"doc{i}.loss"].item()) < 1e-5, f"{where} doc {i}"
    assert abs(loss.item() - mean_loss.item()) < 1e-5, where


def assert_backend_gradients_agree(model, packed, backends=("eager", "sdpa")) -> None:
    """Gradients of model.loss are finite, non-zero and equal between the training backends."""
    grads = {}
    for backend in backends:
        model.set_attention(backend)
        model.zero_grad()
        model.loss(packed).backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    reference = grads[backends[0]]
    assert reference.keys() == {n for n, _ in model.named_parameters()}
    for n, g in reference.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, n
        for other in backends[1:]:
            torch.testing.assert_close(grads[other][n], g, atol=1e-5, rtol=1e-4, msg=prefixed(n))


def prefix_golden(golden: dict, i: int, n: int, ignore_id: int | None = None) -> tuple:
    """(ids, logits [1, n, V], loss) of the first n tokens of golden document i, as a document of its own. Attention
    is causal, so its upstream logits are the first n rows of the whole document's; its loss is their cross-entropy
    (in float64) against its own next tokens, targets equal to `ignore_id` (LLaVA's image placeholders) left out."""
    import torch.nn.functional as F

    ids = golden[f"doc{i}.input_ids"][0, :n]
    logits = golden[f"doc{i}.logits"][:, :n]
    targets = ids[1:] if ignore_id is None else ids[1:].masked_fill(ids[1:] == ignore_id, -100)
    loss = F.cross_entropy(logits[0, :-1].double(), targets, ignore_index=-100).float()
    return ids, logits, loss


def with_equal_length_neighbours(golden: dict) -> tuple[dict, list]:
    """The three golden documents plus, after each of the two shorter ones, a prefix of the longest of the same
    length: a pack of lengths [a, a, b, b, c] whose equal-length neighbours are different documents (sdpa runs
    them as one batched call). Returns goldens for the five, keyed doc0..doc4 as in the fixture, and their ids."""
    docs = [golden[f"doc{i}.input_ids"][0] for i in range(3)]
    longest = max(range(3), key=lambda i: len(docs[i]))
    entries = []
    for i in sorted(range(3), key=lambda i: len(docs[i])):
        entries.append((docs[i], golden[f"doc{i}.logits"], golden[f"doc{i}.loss"]))
        if i != longest:
            entries.append(prefix_golden(golden, longest, len(docs[i])))
    lens = [len(ids) for ids, _, _ in entries]
    assert lens[0] == lens[1] and lens[2] == lens[3] and len(set(lens)) == 3, lens
    out = {}
    for j, (ids, logits, loss) in enumerate(entries):
        out[f"doc{j}.input_ids"], out[f"doc{j}.logits"], out[f"doc{j}.loss"] = ids[None], logits, loss
    return out, [ids for ids, _, _ in entries]


def converted_fixture(name: str, tmp_dir: Path):
    """(HF fixture dir, its zoo conversion through the CLI, goldens, the documents' token ids). The documents are
    the fixture's three and two prefixes that make equal-length neighbours (`with_equal_length_neighbours`)."""
    from safetensors.torch import load_file

    from convert import hf_to_zoo

    src = fixture_dir(name)
    zoo_dir = tmp_dir / "zoo"
    hf_to_zoo.main([str(src), str(zoo_dir), "--quiet"])
    golden, docs = with_equal_length_neighbours(load_file(src / "golden.safetensors"))
    return src, zoo_dir, golden, docs
