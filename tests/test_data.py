"""Recipe data: pretraining windows, first-fit-decreasing SFT packing, assistant-only loss, bad input."""

import json

import pytest
import torch

from recipes.data import LlavaData, PretrainData, SFTData, first_fit_decreasing
from recipes.data.tokenizer_choice import ASSETS, Tokenizer, find_tokenizer
from zoo import IGNORE_INDEX
from zoo.errors import ZooError


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ASSETS)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_first_fit_decreasing():
    lengths = [7, 3, 5, 2, 8, 1, 4, 6]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every sample once, never split
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 36 tokens need 4 bins of 10: FFD finds that here ([8,2], [7,3], [6,4], [5,1])
    with pytest.raises(ValueError):
        first_fit_decreasing([11], 10)


def test_pretrain_windows(tmp_path, tok):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "one two three four five six seven " * k} for k in (3, 5, 2, 7)])
    data = PretrainData(str(tmp_path), tok, 16, seed=0)
    assert len(data) == data.stats["tokens"] // 16
    seen = set()
    for g in range(len(data)):
        p = data.pack(g)
        assert p.num_tokens == 16
        assert int((p.labels != IGNORE_INDEX).sum()) == data.num_loss_tokens(g)
        starts = p.cu_seqlens[:-1].long()
        assert (p.position_ids[starts] == 0).all()  # positions restart in every document piece
        seen.add(data.index(g))
    assert seen == set(range(len(data)))  # one epoch visits every window once
    again = PretrainData(str(f), tok, 16, seed=0)
    assert [again.index(g) for g in range(2 * len(data))] == [data.index(g) for g in range(2 * len(data))]
    assert [data.index(g) for g in range(len(data))] != [data.index(g) for g in range(len(data), 2 * len(data))]
    # <s> opens every document: documents become separate pieces
    bos_rows = (data.stream == tok.bos_id).nonzero().squeeze(1).tolist()
    assert len(bos_rows) == 4


def test_sft_masks_only_assistant(tmp_path, tok):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there?"},
                          {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two three"},
                          {"role": "user", "content": "more"}, {"role": "assistant", "content": "four"}]}]
    write_jsonl(tmp_path / "c.jsonl", rows)
    data = SFTData(str(tmp_path / "c.jsonl"), tok, 128, seed=0)
    assert data.stats["no_assistant"] == 1 and data.stats["used"] == 2
    assert len(data) == 1  # both fit one pack, whole
    p = data.pack(0)
    targets = p.labels[p.labels != IGNORE_INDEX].tolist()
    assert int((p.labels != IGNORE_INDEX).sum()) == data.num_loss_tokens(0)
    text = tok.decode(targets)
    assert text.replace(" ", "") == "Hello.<|im_end|>onetwothree<|im_end|>four<|im_end|>"
    for word in ("Be", "brief", "Hi", "Count", "more", "system", "user", "assistant"):
        assert word not in text  # no loss on system, user or role tokens


def test_sft_overlong_truncate_or_drop(tmp_path, tok):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 60}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    f = write_jsonl(tmp_path / "c.jsonl", [long, short])
    cut = SFTData(str(f), tok, 32, seed=0, overlong="truncate")
    assert (cut.stats["truncated"], cut.stats["dropped"], cut.stats["used"]) == (1, 0, 2)
    assert all(cut.pack(g).num_tokens <= 32 for g in range(len(cut)))
    drop = SFTData(str(f), tok, 32, seed=0, overlong="drop")
    assert (drop.stats["truncated"], drop.stats["dropped"], drop.stats["used"]) == (0, 1, 1)


def test_bundled_chat_set_packs_densely(tok):
    data = SFTData(None, tok, 512, seed=0)
    assert data.stats["samples"] >= 300 and data.stats["fill"] > 0.9


def test_malformed_jsonl_names_file_and_line(tmp_path, tok):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, '{"text": "broken', {"text": "x"}])
    with pytest.raises(ZooError, match=r"bad\.jsonl:2:\d+: malformed JSON"):
        PretrainData(str(f), tok, 4, seed=0)
    g = write_jsonl(tmp_path / "bad2.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ZooError, match=r"bad2\.jsonl:1: expected"):
        SFTData(str(g), tok, 64, seed=0)
    with pytest.raises(ZooError, match="does not exist"):
        PretrainData(str(tmp_path / "nope"), tok, 4, seed=0)


def test_missing_tokenizer_says_where(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ZooError, match=f"looked for {tmp_path}/tokenizer.json and {tmp_path}/tokenizer.model"):
        find_tokenizer(None, str(tmp_path))
    with pytest.raises(ZooError, match="no tokenizer for preset llama-3-8b: looked for"):
        find_tokenizer(None, "llama-3-8b")
    assert find_tokenizer(None, "debug").vocab_size == 2048


def test_pack_is_deterministic_tensor(tok):
    a = PretrainData(None, tok, 64, seed=3).pack(5)
    b = PretrainData(None, tok, 64, seed=3).pack(5)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)


def test_llava_instruct_layout(tmp_path, tok):
    from recipes.llava import debug_llava

    config = debug_llava()
    rows = [{"id": "a", "image": "a.png", "conversations": [{"from": "human", "value": "Describe it."},
                                                            {"from": "gpt", "value": "A square."}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
            {"id": "c", "image": "c.png", "conversations": [{"from": "human", "value": "<image>\nAnd?"}]}]
    (tmp_path / "a.png").write_bytes(b"not read before packing")
    (tmp_path / "data.json").write_text(json.dumps(rows))
    data = LlavaData(str(tmp_path / "data.json"), None, tok, 128, 0, config)
    assert (data.stats["used"], data.stats["images"], data.stats["no_assistant"]) == (2, 1, 1)
    with_image = next(ids for ids, _ in data.samples if (ids == config.image_token_id).any())
    assert int((with_image == config.image_token_id).sum()) == config.image_tokens  # <image> expanded in place
    rows[0]["image"] = "missing.png"
    (tmp_path / "data.json").write_text(json.dumps(rows))
    with pytest.raises(ZooError, match=r"data\.json:1: image .*missing\.png not found"):
        LlavaData(str(tmp_path / "data.json"), None, tok, 128, 0, config)


def test_llava_synthetic_default(tok):
    from recipes.llava import debug_llava

    config = debug_llava()
    data = LlavaData(None, None, tok, 128, 0, config, synthetic=16)
    p = data.pack(0)
    n_images = p.pixel_values.shape[0]
    assert int((p.input_ids == config.image_token_id).sum()) == n_images * config.image_tokens
    assert p.pixel_values.shape[1:] == (3, 32, 32)


def test_llava_real_images_are_read_and_preprocessed(tmp_path, tok):
    """Image files from the folder go through LLaVA-1.5's pad-to-square + CLIP preprocessing into the pack."""
    from PIL import Image

    from recipes.llava import debug_llava
    from zoo.io.image import clip_preprocess

    config = debug_llava()
    Image.new("RGB", (40, 24), (200, 30, 10)).save(tmp_path / "wide.png")
    rows = [{"id": "w", "image": "wide.png", "conversations": [{"from": "human", "value": "<image>\nColor?"},
                                                               {"from": "gpt", "value": "Red."}]}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    data = LlavaData(str(tmp_path / "data.json"), None, tok, 128, 0, config)
    packed = data.pack(0)
    with Image.open(tmp_path / "wide.png") as im:
        expected = clip_preprocess(im, size=config.vision.image_size, pad=True)
    assert packed.pixel_values.shape == (1, 3, config.vision.image_size, config.vision.image_size)
    torch.testing.assert_close(packed.pixel_values[0], expected)
    assert int((packed.input_ids == config.image_token_id).sum()) == config.image_tokens


@pytest.mark.parametrize("raw, match", [
    (b'{"text": "caf\xe9"}\n', r"x\.jsonl:1:14: not UTF-8 \(byte 0xe9\)"),
    (b'{"text": "ok"}\n{"text": "\\ud800 alone"}\n', r"x\.jsonl:2: a lone surrogate escape \(\\ud800\)"),
    (b"[" * 100_000 + b"\n", r"x\.jsonl:1: expected JSON nested at most 100 deep, got 100000 levels"),
    (b'{"text": 1,}\n', r"x\.jsonl:1:12: malformed JSON"),
])
def test_data_errors_name_file_line_and_column(tmp_path, raw, match):
    from recipes.data import read_jsonl

    (tmp_path / "x.jsonl").write_bytes(raw)
    with pytest.raises(ZooError, match=match):
        list(read_jsonl([tmp_path / "x.jsonl"]))
