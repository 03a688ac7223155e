"""Shared test setup: the golden fixtures beside the checkout, deterministic single-threaded CPU math."""

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"

# The fixtures' goldens were computed single-threaded; multi-threaded CPU reductions move fp32 logits by ~1e-5.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"golden fixture {path} is missing (../shared/fixtures must sit beside the checkout)")
    return path
