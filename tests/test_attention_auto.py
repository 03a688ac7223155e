"""`attn="auto"` picks per pack from its longest document: cuDNN's sdpa for long documents on a GPU that has it,
the varlen kernel below the threshold; checked on CPU by the choice it makes for given packs."""

import pytest
import torch

import zoo
from zoo.core import attention
from zoo.core.attention import CUDNN_CAPABILITY, SDPA_LONGEST_DOC, auto_choice

H100, A100 = (9, 0), (8, 0)


@pytest.mark.parametrize("longest, want", [(1, "flash_varlen"), (SDPA_LONGEST_DOC - 1, "flash_varlen"),
                                           (SDPA_LONGEST_DOC, "sdpa"), (4 * SDPA_LONGEST_DOC, "sdpa")])
def test_choice_by_longest_document(longest, want):
    assert auto_choice(H100, torch.bfloat16, longest) == want
    assert auto_choice(H100, torch.float16, longest) == want


def test_choice_by_device_dtype_window_and_kernel():
    long = 4 * SDPA_LONGEST_DOC
    assert CUDNN_CAPABILITY == (9, 0)
    assert auto_choice(A100, torch.bfloat16, long) == "flash_varlen"  # no cuDNN attention before Hopper
    assert auto_choice(H100, torch.bfloat16, long, window=4096) == "flash_varlen"  # sdpa would mask a band per run
    assert auto_choice(H100, torch.float32, long) == "flex"
    assert auto_choice(H100, torch.bfloat16, 10, varlen=False) == "sdpa"
    assert auto_choice(None, torch.bfloat16, long) == auto_choice(None, torch.float32, 10) == "sdpa"  # CPU


def test_auto_dispatches_per_pack(monkeypatch):
    """auto on a (pretend) H100: each pack goes to the backend auto_choice names for its longest document."""
    called = []
    for name in ("sdpa", "flash_varlen"):
        monkeypatch.setitem(attention.BACKENDS, name,
                            lambda q, k, v, packed, scale=None, window=None, name=name: called.append(name) or q)
    monkeypatch.setattr(attention, "_capability", lambda index: H100)
    monkeypatch.setattr(attention, "varlen_kernel", lambda: object())

    class FakeCuda:  # what auto reads of q's device
        type, index = "cuda", 0

    class Q:
        device, dtype = FakeCuda(), torch.bfloat16

    q = Q()
    for lens, want in (([100, 2000], "flash_varlen"), ([5, SDPA_LONGEST_DOC, 3], "sdpa")):
        packed = zoo.pack([torch.zeros(n, dtype=torch.long) for n in lens])
        assert attention.auto(q, q, q, packed) is q
        assert called[-1] == want
    attention.auto(q, q, q, zoo.pack([torch.zeros(SDPA_LONGEST_DOC, dtype=torch.long)]), window=16)
    assert called[-1] == "flash_varlen"
    assert called == ["flash_varlen", "sdpa", "flash_varlen"]
