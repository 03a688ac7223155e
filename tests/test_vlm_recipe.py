"""recipes.vlm on tiny checkpoints saved by transformers' own Qwen2_5_VLForConditionalGeneration and
Gemma3ForConditionalGeneration (and Qwen3VLForConditionalGeneration, Qwen3_5ForConditionalGeneration), each with a
tokenizer and chat template of its family's shape:

- the built-in default trains and its loss goes down;
- TRL rows (two images of different sizes in one turn, several turns, a text-only row) and a LLaVA row give exactly
  the ids of transformers' tokenizer on its chat template's text expanded as the processor expands it, and targets
  on the assistant turns only (never an image token); one pack's loss equals transformers' on each document alone
  with the same labels (fp32, 1e-5);
- --train merger changes the merger and nothing else; --export-hf loads in transformers and greedy-generates with
  an image what zoo generates, and a LoRA run's OUT/adapter (the language model's and the tower's adapters, the
  merger in full) over transformers' base model in PEFT gives the merged model's logits;
- on Qwen3-VL and Qwen3.5 the recipe trains (the loss falls), and its --export-hf loads in transformers as the
  checkpoint's own class and greedy-generates with an image what zoo generates;
- bad input (a missing image, a row whose placeholders do not match its images, a path out of the folder) is one
  line, exit code 2 (recipes.engine.command.cli, as `python -m recipes.vlm` runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _tiny_qwen3_vl as tiny_qwen3
import _tiny_qwen_vl as tiny_qwen
import pytest
import torch
from PIL import Image

import zoo
from recipes import vlm
from recipes.data.tokenizer_choice import ASSETS
from recipes.data.vlm import VLMData
from recipes.engine.command import cli
from zoo.errors import ZooError
from zoo.generate import generate
from zoo.io.image import preprocess
from zoo.io.tokenizer import Tokenizer

GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}{%- set role = 'model' if message['role'] == 'assistant' else "
    "message['role'] -%}{{ '<start_of_turn>' + role + '\\n' }}{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'image' "
    "-%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}{%- endif -%}")
GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")


def randomize(model, seed: int) -> None:
    """Every parameter off its init: norms around 1, biases around 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in n or "ln_q" in n else 0.3 * noise if n.endswith(".bias")
                    else (0.1 if "embed" in n else 0.2) * noise)


def save_qwen(path: Path):
    """Qwen2.5-VL over the bundled VLM tokenizer (its vision tokens' ids), and that tokenizer."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok = Tokenizer(ASSETS / "vlm")
    config = tiny_qwen.hf_config()
    config.text_config.vocab_size = tok.id_bound + 5
    config.image_token_id, config.video_token_id = tok.token_to_id("<|image_pad|>"), tok.id_bound + 4
    config.vision_start_token_id = tok.token_to_id("<|vision_start|>")
    config.vision_end_token_id = tok.token_to_id("<|vision_end|>")
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(config).eval()
    randomize(hf, 1)
    hf.save_pretrained(path)
    processor = json.loads(json.dumps(tiny_qwen.PROCESSOR))  # a copy: pixels from 8 x 8 to 32 x 32
    processor["image_processor"]["size"] = {"shortest_edge": 64, "longest_edge": 32 * 32}
    (path / "processor_config.json").write_text(json.dumps(processor))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "vlm" / f, path / f)
    return hf


def save_gemma(path: Path):
    """Gemma 3 with its eyes over the bundled BPE with Gemma's turn and image tokens added, a Gemma 3 style template."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    path.mkdir(parents=True)
    raw = json.loads((ASSETS / "tokenizer.json").read_text())
    raw["post_processor"] = None
    hf_tok = HFTokenizer.from_str(json.dumps(raw))
    hf_tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_TOKENS])
    hf_tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<end_of_turn>", "pad_token": "<pad>", "chat_template": GEMMA_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    ids = {t: hf_tok.token_to_id(t) for t in GEMMA_TOKENS}
    text = Gemma3TextConfig(vocab_size=hf_tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                            max_position_embeddings=1024, sliding_window=3,
                            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=20,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                image_size=56, patch_size=14)  # 4 x 4 patches pooled to 4 soft tokens
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    randomize(hf, 1)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {"qwen": (save_qwen(root / "qwen"), root / "qwen"), "gemma": (save_gemma(root / "gemma"), root / "gemma")}


def write_rows(folder: Path) -> list[tuple[list[dict], list[Image.Image]]]:
    """TRL rows in folder/data.jsonl (their images beside it) and one LLaVA row in folder/llava.json, the images
    of different sizes; returns each row's messages and images in reading order (data.jsonl, then llava.json)."""
    folder.mkdir(exist_ok=True)
    (folder / "img").mkdir(exist_ok=True)
    sizes = {"a.png": (16, 24), "b.png": (32, 16), "c.png": (24, 24)}
    images = {}
    for k, (name, size) in enumerate(sizes.items()):
        g = torch.Generator().manual_seed(k)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
        images[name] = Image.fromarray(pixels.numpy())
        images[name].save(folder / "img" / name)
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                        {"type": "text", "text": "Which is brighter?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "The first one."}]},
           {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "More white."}]}]
    text = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
    rows = [{"messages": two, "images": ["img/a.png", "img/b.png"]}, {"messages": text}]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llava = [{"image": "img/c.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                      {"from": "gpt", "value": "Noise."}]}]
    (folder / "llava.json").write_text(json.dumps(llava))
    llava_msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]}]
    return [(two, [images["a.png"], images["b.png"]]), (text, []), (llava_msgs, [images["c.png"]])]


def expected(hf_tok, model, family: str, msgs: list[dict], images: list[Image.Image]) -> tuple[list[int], list[bool]]:
    """transformers' ids of the conversation as its processor writes them (the chat template's text, each image's
    placeholder expanded to the tokens the preprocessing gives it), and the assistant turns' tokens (after the
    assistant header, through the end-of-turn token)."""
    text = hf_tok.apply_chat_template(msgs, tokenize=False)
    for im in images:  # one placeholder at a time, in order
        if family == "qwen":
            n = int(preprocess(model, [im]).grid_thw.prod()) // 4
            text = text.replace("<|image_pad|>", "<|IMG|>" * n, 1)
        else:
            text = text.replace("<start_of_image>", "\n\n<|BOI|>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n", 1)
    text = text.replace("<|IMG|>", "<|image_pad|>").replace("<|BOI|>", "<start_of_image>")
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    header = hf_tok("<|im_start|>assistant\n" if family == "qwen" else "<start_of_turn>model\n",
                    add_special_tokens=False)["input_ids"]
    end = hf_tok.convert_tokens_to_ids("<|im_end|>" if family == "qwen" else "<end_of_turn>")
    mask, inside = [False] * len(ids), False
    for i in range(len(ids)):
        if ids[i - len(header) + 1:i + 1] == header and i >= len(header) - 1:
            inside = True
            continue
        mask[i] = inside
        if ids[i] == end:
            inside = False
    return ids, mask


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_rows_give_the_processors_ids_and_the_loss_equals_transformers(checkpoints, family, tmp_path):
    from transformers import AutoTokenizer

    hf, path = checkpoints[family]
    model = zoo.load(path, attn="eager")
    rows = write_rows(tmp_path)
    tok = Tokenizer(path)
    image_id = model.config.image_token_id
    data = VLMData(str(tmp_path), None, tok, 512, 0, expand=vlm.expander(model), preprocess=model.preprocess_images,
                   image_token_id=image_id)
    hf_tok = AutoTokenizer.from_pretrained(path)
    # list_files sorts: data.jsonl before llava.json
    for (ids, mask), (msgs, images) in zip(data.samples, rows, strict=True):
        want_ids, want_mask = expected(hf_tok, model, family, msgs, images)
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask
        assert not mask[ids == image_id].any() and mask.any()
    assert sum(int((ids == image_id).sum()) for ids, _ in data.samples) == (6 + 8 + 9 if family == "qwen" else 3 * 4)

    # the pack's loss against transformers on each document alone, placeholders and non-assistant tokens -100
    assert len(data) == 1
    packed = data.in_order(0)
    loss = model.loss(packed)
    total, count = torch.zeros(()), 0
    cu = packed.cu_seqlens.tolist()
    pixels = [preprocess(model, imgs) if imgs else None for _, imgs in rows]  # sample j is row j
    for d, j in enumerate(data.items[0]):  # the pack's documents, in the order they were packed
        ids, mask = data.samples[j]
        assert torch.equal(packed.input_ids[cu[d]:cu[d + 1]], ids)
        labels = ids.masked_fill(~mask | (ids == image_id), -100)[None]
        im = pixels[j]
        kw = {}
        if im is not None and family == "qwen":
            kw = dict(pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
                      mm_token_type_ids=(ids == image_id).long()[None])
        elif im is not None:
            kw = dict(pixel_values=im, token_type_ids=(ids == image_id).long()[None])
        with torch.no_grad():
            out = hf(input_ids=ids[None], labels=labels, **kw)
        n = int((labels[0, 1:] != -100).sum())
        total, count = total + out.loss * n, count + n
    assert count == packed.count_targets(model.labels)
    torch.testing.assert_close(loss.detach(), total / count, atol=1e-5, rtol=0)


def test_default_trains_and_the_loss_goes_down(tmp_path):
    losses = vlm.main(["--steps", "10", "--batch-tokens", "512", "--out", str(tmp_path / "out"), "--no-progress",
                       "--save-every", "0"])
    assert len(losses) == 10 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.85 * sum(losses[:3]) / 3


def test_train_merger_only_changes_the_merger(checkpoints, tmp_path):
    _, path = checkpoints["qwen"]
    write_rows(tmp_path / "data")
    out = tmp_path / "out"
    vlm.main(["--model", str(path), "--data", str(tmp_path / "data"), "--train", "merger", "--steps", "2",
              "--lr", "1e-2", "--warmup", "0", "--batch-tokens", "256", "--seq-len", "256", "--out", str(out),
              "--no-progress", "--save-every", "0"])
    base = zoo.load(path)
    before, after, parts = base.state_dict(), zoo.load(out / "model").state_dict(), vlm.parts_of(base)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    merger = {n for n in before if parts[n] == "merger"}
    assert merger == {n for n in before if n.startswith("vision.merger.")} and changed == merger
    assert set(parts.values()) == {"vision", "merger", "language"}


def test_export_hf_generates_as_zoo_and_the_adapter_loads_in_peft(checkpoints, tmp_path):
    """LoRA on the language model and the tower, the merger in full: OUT/model-hf greedy-generates with an image what
    OUT/model generates, and OUT/adapter over transformers' base model in PEFT gives the merged model's logits."""
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    _, path = checkpoints["qwen"]
    rows = write_rows(tmp_path / "data")
    out = tmp_path / "out"
    vlm.main(["--model", str(path), "--data", str(tmp_path / "data"), "--train", "vision,merger,language",
              "--lora-rank", "4", "--lora-vision", "--steps", "2", "--lr", "1e-2", "--warmup", "0", "--batch-tokens",
              "256", "--seq-len", "256", "--out", str(out), "--no-progress", "--save-every", "0", "--export-hf"])
    model = zoo.load(out / "model", attn="eager")
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "model-hf").eval()
    data = VLMData(str(tmp_path / "data"), None, Tokenizer(out / "model"), 512, 0, expand=vlm.expander(model),
                   preprocess=model.preprocess_images, image_token_id=model.config.image_token_id)
    ids = data.samples[0][0][:-6]  # the first turn, cut inside the answer
    im = preprocess(model, rows[0][1])
    kw = dict(pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
              mm_token_type_ids=(ids == model.config.image_token_id).long()[None])
    ours = generate(model, [ids], images=[im], max_new_tokens=8)[0].tolist()
    want = hf.generate(input_ids=ids[None], **kw, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert ours == want[0, len(ids):].tolist() and ours
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.visual.merger"]
    assert "model\\.visual\\.blocks" in config["target_modules"]
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        before = base(input_ids=ids[None], **kw).logits
        merged = hf(input_ids=ids[None], **kw).logits
        adapted = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids[None], **kw).logits
    torch.testing.assert_close(adapted, merged, atol=1e-4, rtol=0)
    assert (before - merged).abs().max() > 0.1  # the adapter matters


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl"])
def test_qwen3_families_train_and_export_hf_generates_as_zoo(name, tmp_path):
    """A tiny Qwen3-VL (DeepStack), Qwen3.5 (Gated DeltaNet layers) and Qwen3.5-MoE (experts, balanced by the
    checkpoint's router_aux_loss_coef) from transformers' own classes, over the bundled VLM tokenizer: a few full
    fine-tuning steps, then OUT/model-hf in transformers equals OUT/model."""
    from transformers import AutoModelForImageTextToText

    tok = Tokenizer(ASSETS / "vlm")
    ids = dict(image_token_id=tok.token_to_id("<|image_pad|>"), video_token_id=tok.id_bound + 4,
               vision_start_token_id=tok.token_to_id("<|vision_start|>"),
               vision_end_token_id=tok.token_to_id("<|vision_end|>"))
    path = tmp_path / "base"
    ref = tiny_qwen3.build(name, ids=ids, vocab=tok.id_bound + 5)
    ref.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(tiny_qwen3.PROCESSOR))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "vlm" / f, path / f)
    rows = write_rows(tmp_path / "data")
    out = tmp_path / "out"
    losses = vlm.main(["--model", str(path), "--data", str(tmp_path / "data"), "--train", "vision,merger,language",
                       "--steps", "6", "--lr", "3e-3", "--warmup", "0", "--batch-tokens", "512", "--seq-len", "512",
                       "--out", str(out), "--no-progress", "--save-every", "0", "--export-hf"])
    assert len(losses) == 6 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses  # the same pack every step: it is learned
    rows_logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    aux = [r["aux_loss"] for r in rows_logged if "aux_loss" in r]
    if name == "qwen3_5_moe_vl":  # --aux-loss-coef auto: the checkpoint's 0.001, its terms logged every step
        assert len(aux) == 6 and all(a > 0 for a in aux), rows_logged[:2]
        with pytest.raises(ZooError, match=r"^--router-bias-update-rate .* vision-language model's experts with "):
            vlm.main(["--model", str(path), "--data", str(tmp_path / "data"), "--steps", "1", "--out",
                      str(tmp_path / "bias"), "--no-progress", "--router-bias-update-rate", "0.001"])
        assert not (tmp_path / "bias").exists()  # refused before anything is written
    else:
        assert aux == []
    model = zoo.load(out / "model", attn="eager")
    hf = AutoModelForImageTextToText.from_pretrained(out / "model-hf").eval()
    assert type(hf) is type(ref)
    data = VLMData(str(tmp_path / "data"), None, Tokenizer(out / "model"), 512, 0, expand=vlm.expander(model),
                   preprocess=model.preprocess_images, image_token_id=model.config.image_token_id)
    ids_T = data.samples[0][0][:-6]  # the first turn (two images), cut inside the answer
    im = preprocess(model, rows[0][1])
    kw = dict(pixel_values=im.pixel_values, image_grid_thw=im.grid_thw,
              mm_token_type_ids=(ids_T == model.config.image_token_id).long()[None])
    with torch.no_grad():  # the trained model answers with its end of turn soon: the logits of the prompt, too
        torch.testing.assert_close(model(zoo.pack([ids_T], images=[im])), hf(input_ids=ids_T[None], **kw).logits[0],
                                   atol=2e-4, rtol=0)
    ours = generate(model, [ids_T], images=[im], max_new_tokens=8, stop=[])[0].tolist()
    want = hf.generate(input_ids=ids_T[None], **kw, max_new_tokens=8, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    assert ours == want[0, len(ids_T):].tolist() and len(ours) == 8


@pytest.mark.parametrize("case", ["missing", "placeholders", "escape"])
def test_bad_input_is_one_line(case, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "outside.png")
    Image.new("RGB", (16, 16)).save(tmp_path / "in" / "ok.png")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"}]
    row = {"missing": {"messages": msgs, "images": ["nothere.png"]},
           "placeholders": {"messages": msgs, "images": ["ok.png", "ok.png"]},
           "escape": {"messages": msgs, "images": ["../outside.png"]}}[case]
    (tmp_path / "in" / "d.jsonl").write_text(json.dumps(row) + "\n")
    args = ["--data", str(tmp_path / "in" / "d.jsonl"), "--out", str(tmp_path / "o"), "--steps", "1"]
    want = {"missing": "not found", "placeholders": "hold 1 image placeholder", "escape": "not a plain file name"}[case]
    with pytest.raises(SystemExit) as exit:
        cli(lambda: vlm.main(args))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and want in err, err
    assert "d.jsonl:1" in err


def test_gemma_refuses_the_ring_in_one_line(checkpoints, tmp_path):
    """Gemma 3's image tokens attend both ways: only Ulysses runs them across ranks, said before any process starts."""
    with pytest.raises(ZooError, match="--sp-mode ring: Gemma 3's image tokens attend both ways"):
        vlm.main(["--model", str(checkpoints["gemma"][1]), "--sp", "2", "--sp-mode", "ring", "--out", str(tmp_path)])
