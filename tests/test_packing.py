"""zoo.pack / zoo.as_packed: the fields of a Packed, its errors, and a forward from input_ids + cu_seqlens."""

import dataclasses

import pytest
import torch

import zoo


def test_pack_fields_and_errors():
    p = zoo.pack([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])])
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.cu_seqlens.dtype == torch.int32
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert p.labels.tolist() == [6, 7, -100, -100, 10, -100]
    assert p.max_seqlen == 3
    masked = zoo.pack([torch.tensor([5, 6, 7, 8])], label_masks=[torch.tensor([0, 0, 1, 1])])
    assert masked.labels.tolist() == [-100, 7, 8, -100]
    with pytest.raises(ValueError, match="document 1 must be a non-empty 1-D tensor"):
        zoo.pack([torch.tensor([1]), torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="zoo has no batch dimension"):
        zoo.load("debug", device="meta")(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        zoo.as_packed(torch.zeros(5, dtype=torch.long), torch.tensor([0, 3, 3, 5], dtype=torch.int32))


def test_forward_from_cu_seqlens_equals_packed():
    model = zoo.load("debug", attn="sdpa")
    docs = [torch.randint(0, 2048, (n,)) for n in (6, 1, 9)]
    p = zoo.pack(docs)
    with torch.no_grad():
        torch.testing.assert_close(model(p.input_ids, cu_seqlens=p.cu_seqlens), model(p))
        alone = model(docs[2])
    torch.testing.assert_close(model(p)[7:], alone, atol=1e-5, rtol=1e-5)


def test_a_pack_is_the_pack_and_its_copies_share_what_is_derived_from_it():
    """A Packed holds the pack's fields alone. A copy (replace, .to onto its own device, FSDP's input cast, which
    rebuilds it field by field) keeps them and finds what was derived from the pack; other boundaries derive anew."""
    from torch.distributed.utils import _apply_to_tensors

    from zoo.core.attention import _doc_runs

    p = zoo.pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], images=[None, torch.zeros(3, 4, 4)])
    assert [f.name for f in dataclasses.fields(p)] == ["input_ids", "cu_seqlens", "position_ids", "max_seqlen",
                                                       "labels", "pixel_values", "doc_len", "images_per_doc",
                                                       "image_grid_thw", "position_ids_3T", "blocks", "memo"]
    assert p.part_of() is None and p.seqlens() == [3, 2] and p.count_targets() == 3
    runs = _doc_runs(p)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, p)
    assert type(cast) is zoo.Packed and cast is not p and cast.pixel_values.dtype == torch.bfloat16
    for copy in (dataclasses.replace(p), p.to("cpu"), cast):
        assert _doc_runs(copy) is runs and copy.memo is p.memo and copy.images_per_doc == [0, 1]
        assert copy.doc_len_per_token().tolist() == [3, 3, 3, 2, 2] and torch.equal(copy.labels, p.labels)
    other = dataclasses.replace(p, cu_seqlens=torch.tensor([0, 1, 5], dtype=torch.int32))
    assert other.memo is not p.memo and other.seqlens() == [1, 4] and _doc_runs(other) == [(1, 1), (4, 1)]
    assert other.doc_len_per_token().tolist() == [1, 4, 4, 4, 4]
    assigned = dataclasses.replace(p)
    assigned.cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert assigned.seqlens() == [2, 3] and p.seqlens() == [3, 2] and _doc_runs(p) is runs
    # a target rule and a caller's denominator are the loss's, not the pack's
    model = zoo.load("debug", attn="sdpa")
    q = zoo.pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    with torch.no_grad():
        torch.testing.assert_close(model.loss(q, denominator=6), model.loss(q) * 3 / 6)


def test_bad_ids_and_cu_seqlens_are_one_zoo_error():
    model = zoo.load("debug", attn="sdpa")
    V = model.config.vocab_size
    with pytest.raises(zoo.ZooError, match=f"token id {V + 5} is outside the model's vocabulary of {V}"):
        model(zoo.pack([torch.tensor([1, V + 5, 2])]))
    with pytest.raises(zoo.ZooError, match="token id -1 is outside"):
        model.loss(zoo.pack([torch.tensor([1, -1, 2])]))
    for cu in (torch.tensor([0.0, 3.0]), [0, 3], torch.tensor(3)):
        with pytest.raises(zoo.ZooError, match="cu_seqlens must be a 1-D integer tensor"):
            zoo.as_packed(torch.tensor([1, 2, 3]), cu)
    with pytest.raises(zoo.ZooError, match="pack\\(\\) expects a non-empty list"):
        zoo.pack([])
