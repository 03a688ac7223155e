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


def test_shard_fields_travel_with_to_and_replace():
    """A copy (replace, .to) keeps the public fields; derived state is never shared between copies."""
    p = zoo.pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], images=[None, torch.zeros(3, 4, 4)])
    assert p.images_per_doc == [0, 1] and p.doc_lens == [3, 2] and not p.is_shard
    q = dataclasses.replace(p, num_loss_tokens=7, token_index=torch.tensor([4, 0]), global_input_ids=p.input_ids)
    assert q.seqlens() == [3, 2] and q.loss_denominator() == 7
    moved = q.to("cpu")
    assert torch.equal(moved.token_index, q.token_index) and torch.equal(moved.global_input_ids, p.input_ids)
    assert moved.images_per_doc == [0, 1] and moved.doc_len_per_token().tolist() == [3, 3, 3, 2, 2]


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
