"""zoo.generate: greedy decoding with a KV cache equals transformers' greedy generate token for token (Llama,
LLaVA), and equals decoding without a cache (InternLM2 with dynamic NTK past max_position_embeddings, OpenELM)."""

from __future__ import annotations

import pytest
import torch
from test_llama_parity import CONFIGS, make_hf
from torch._dynamo.utils import counters

import zoo
from zoo.core.layers import init_weights
from zoo.generate import generate
from zoo.generate.cache import CachedAttention, KVCache, decode_pack
from zoo.models.internlm2 import InternLM2, InternLM2Config
from zoo.models.llama import Llama, LlamaConfig
from zoo.models.openelm import OpenELM, OpenELMConfig

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [7, 1, 12]  # different lengths, one a single token


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lens]


def _hf_greedy(hf, prompt: torch.Tensor, max_new: int, eos: int | None) -> list[int]:
    out = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_greedy_equals_transformers(tmp_path, name):
    """Llama 2 (MHA), 3 (GQA, theta 5e5), 3.1 (llama3 RoPE scaling), 3.2-style tied head: all prompts at once."""
    hf, path = make_hf(tmp_path, name)
    model = zoo.load(path, attn="sdpa")
    prompts = _prompts(hf.config.vocab_size)
    got = generate(model, prompts, max_new_tokens=20)
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == _hf_greedy(hf, prompt, 20, None)
    assert model.attend is zoo.get_attention("sdpa")  # the model's own attention is back


def test_stop_ids_end_each_sequence_where_transformers_does(tmp_path):
    hf, path = make_hf(tmp_path, "gqa")
    model = zoo.load(path, attn="eager")
    prompts = _prompts(hf.config.vocab_size)
    free = generate(model, prompts, max_new_tokens=16)
    stop = int(free[0][3])  # a token the first sequence produces: it stops there, the others may run on
    got = generate(model, prompts, max_new_tokens=16, stop=[stop])
    assert got[0].tolist() == free[0][:4].tolist()
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == _hf_greedy(hf, prompt, 16, stop)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_repetition_penalty_equals_transformers(tmp_path, compile):
    """transformers' repetition_penalty (generation_config.json's, the CLI's --repetition-penalty) on greedy decoding:
    the same tokens, prompt tokens penalised from the first step on; and it changes them (else this tells nothing)."""
    hf, path = make_hf(tmp_path, "gqa")
    model = zoo.load(path, attn="sdpa")
    prompts = _prompts(hf.config.vocab_size)
    got = generate(model, prompts, max_new_tokens=20, repetition_penalty=1.5, compile=compile)
    plain = generate(model, prompts, max_new_tokens=20, compile=compile)
    assert any(a.tolist() != b.tolist() for a, b in zip(got, plain))
    for prompt, tokens in zip(prompts, got):
        out = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=20, do_sample=False, repetition_penalty=1.5, pad_token_id=0)
        assert tokens.tolist() == out[0, len(prompt):].tolist()


def _decode_without_cache(model, prompt: torch.Tensor, max_new: int, dynamic_ntk: bool) -> list[int]:
    """Greedy by a full forward over the whole sequence at every step. With InternLM2's dynamic NTK, upstream's
    cache keeps each key rotated with the base of the length at which it was computed (the prompt's length for
    prompt tokens, its own position + 1 for generated ones): doc_len per token says exactly that."""
    seq = prompt.clone()
    for _ in range(max_new):
        T = len(seq)
        packed = zoo.as_packed(seq)
        if dynamic_ntk:
            packed.doc_len = torch.maximum(torch.full((T,), len(prompt)), torch.arange(1, T + 1))
        with torch.no_grad():
            nxt = model(packed)[-1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[len(prompt):].tolist()


def _random(model_cls, cfg):
    torch.manual_seed(3)
    with torch.device("meta"):
        model = model_cls(cfg, attn="sdpa")
    model.to_empty(device="cpu")
    init_weights(model, std=0.2)
    return model


def test_internlm2_dynamic_ntk_while_decoding():
    """max_position_embeddings 8: the 12-token prompt starts past it, the others cross it while decoding, and the
    base is rescaled from the current length at every step, as upstream's cache does."""
    cfg = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200,
                          rope_scaling={"type": "dynamic", "factor": 2.0}, max_seq_len=8)
    model = _random(InternLM2, cfg)
    prompts = _prompts(200)
    got = generate(model, prompts, max_new_tokens=12)
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == _decode_without_cache(model, prompt, 12, dynamic_ntk=True)


def test_internlm2_cached_logits_equal_upstream_rule_every_step():
    """The logits of every cached decoding step equal a full forward under upstream's rule (above), to 1e-5:
    a base rescaled from the wrong length, or a key cached with the wrong rotation, moves them."""
    cfg = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200,
                          rope_scaling={"type": "dynamic", "factor": 4.0}, max_seq_len=6)
    model = _random(InternLM2, cfg)
    prompt = _prompts(200, [5])[0]
    cache = KVCache(1, 16)
    cached = CachedAttention(model.attend, cache)
    model.set_attention(cached)
    with torch.no_grad():
        model.hidden(zoo.pack([prompt]))
        cache.lengths = torch.tensor([5])
        cached.decoding = True
        seq = prompt.clone()
        for token in (7, 9, 11, 13, 17, 19):  # positions 5..10: crossing max_position_embeddings at 6
            seq = torch.cat([seq, torch.tensor([token])])
            cache.begin_step(torch.device("cpu"))
            got = torch.nn.functional.linear(model.hidden(decode_pack(torch.tensor([token]), cache.positions)),
                                             model.head_weight)[0]
            cache.lengths += 1
            T = len(seq)
            full = zoo.as_packed(seq)
            full.doc_len = torch.maximum(torch.full((T,), len(prompt)), torch.arange(1, T + 1))
            model.set_attention(cached.backend)
            want = model(full)[-1]
            model.set_attention(cached)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_openelm_per_layer_heads():
    cfg = OpenELMConfig(dim=64, n_layers=3, head_dim=16, n_heads=(4, 8, 4), n_kv_heads=(2, 4, 1),
                        ffn_dim=(96, 128, 64), qkv_multipliers=(), ffn_multipliers=(), vocab_size=200)
    model = _random(OpenELM, cfg)
    prompts = _prompts(200)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=10)):
        assert tokens.tolist() == _decode_without_cache(model, prompt, 10, dynamic_ntk=False)


def test_sampling_is_seeded_and_filtered(tmp_path):
    _, path = make_hf(tmp_path, "mha")
    model = zoo.load(path)
    prompts = _prompts(300)
    a = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    b = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    assert [t.tolist() for t in a] == [t.tolist() for t in b]
    greedy = generate(model, prompts, max_new_tokens=8)
    top1 = generate(model, prompts, max_new_tokens=8, temperature=0.7, top_k=1, seed=2)
    nucleus = generate(model, prompts, max_new_tokens=8, temperature=0.7, top_p=1e-6, seed=3)
    assert [t.tolist() for t in top1] == [t.tolist() for t in greedy] == [t.tolist() for t in nucleus]


# ---- sampling at temperature > 0: token frequencies against the exact filtered softmax ----


def _filtered_softmax(logits_V: torch.Tensor, temperature: float, top_k: int | None = None,
                      top_p: float | None = None) -> torch.Tensor:
    """What a sampler must draw from, in float64: softmax(logits / temperature), cut to the top_k most likely tokens,
    then to the nucleus (the most likely tokens, in order, until their probability reaches top_p; taken after top-k,
    as transformers' warpers do), renormalised. Written from the definitions, not from zoo.generate._pick."""
    probs = (logits_V.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    if top_k is not None:
        probs[order[top_k:]] = 0
        probs /= probs.sum()
    if top_p is not None:
        above = probs[order].cumsum(0) - probs[order]  # the probability of the tokens ranked above each token
        assert (above - top_p).abs().min() > 0.02, "top_p too close to a cumulative sum: float rounding decides"
        probs[order[above >= top_p]] = 0
        probs /= probs.sum()
    return probs


def _assert_frequencies(tokens: torch.Tensor, want_V: torch.Tensor, what: str) -> None:
    """Every token filtered out never drawn; every kept one drawn at its probability within 5 standard errors (the
    draws are seeded, so this is deterministic; a 5-sigma miss of a correct sampler is a 1-in-a-million draw)."""
    n = len(tokens)
    freq = torch.bincount(tokens, minlength=len(want_V)).double() / n
    assert len(freq) == len(want_V), (what, freq)
    drawn_outside = (freq > 0) & (want_V == 0)
    assert not drawn_outside.any(), f"{what}: drew filtered tokens {drawn_outside.nonzero().flatten().tolist()}"
    bound = 5 * (want_V * (1 - want_V) / n).sqrt() + 1e-12
    assert ((freq - want_V).abs() <= bound).all(), f"{what}: frequencies {freq.tolist()} vs {want_V.tolist()}"


# two rows with different orders and spreads, no ties: V = 8
SAMPLING_LOGITS = torch.tensor([[1.2, -0.3, 2.0, 0.4, -1.5, 0.9, 0.0, -0.8],
                                [-0.5, 1.7, 0.3, -1.0, 1.1, 0.6, -2.0, 0.8]])


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, None, None), (1.5, None, None), (1.0, 3, None),
                                                             (0.8, None, 0.8), (1.2, 5, 0.7)])
def test_sampling_draws_the_filtered_softmax(temperature, top_k, top_p):
    """_pick at temperature > 0 over 2 x 30,000 rows at once (the two rows interleaved): each row's tokens come at
    the probabilities of its own temperature-scaled, top-k / top-p filtered and renormalised softmax."""
    from zoo.generate import _pick

    draws = 30_000
    logits_nV = SAMPLING_LOGITS.repeat(draws, 1)  # rows A, B, A, B, ...
    generator = torch.Generator().manual_seed(11)
    tokens_n = _pick(logits_nV, temperature, top_k, top_p, generator)
    assert tokens_n.shape == (2 * draws,) and tokens_n.dtype == torch.int64
    for row in range(2):
        want = _filtered_softmax(SAMPLING_LOGITS[row], temperature, top_k, top_p)
        assert (want > 0).sum() >= 2  # a real choice, not a forced token
        _assert_frequencies(tokens_n[row::2], want, f"row {row} T={temperature} top_k={top_k} top_p={top_p}")


def test_generate_samples_from_the_models_filtered_softmax():
    """generate() end to end: 20,000 copies of one prompt decode their first token together; its frequencies are the
    filtered softmax of the model's own last-position logits, for the temperature, top_k and top_p passed."""
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=12)
    model = _random(Llama, cfg)
    prompt = torch.tensor([3, 7, 1, 5])
    with torch.no_grad():
        logits_V = model(zoo.pack([prompt]))[-1]
    for temperature, top_k, top_p, seed in [(0.8, None, None, 0), (1.3, 6, 0.8, 1)]:
        want = _filtered_softmax(logits_V, temperature, top_k, top_p)
        assert (want > 0.02).sum() >= 4, want  # the model's distribution is spread enough to tell samplers apart
        got = generate(model, [prompt] * 20_000, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p,
                       stop=[], seed=seed)
        _assert_frequencies(torch.cat(got), want, f"generate T={temperature} top_k={top_k} top_p={top_p}")


def test_bad_input_is_a_clear_error(tmp_path):
    model = zoo.load("debug", attn="sdpa")
    with pytest.raises(zoo.ZooError, match="prompt 1 must be a non-empty 1-D tensor"):
        generate(model, [torch.tensor([1, 2]), torch.tensor([[3]])])
    with pytest.raises(zoo.ZooError, match="top_p"):
        generate(model, [torch.tensor([1, 2])], top_p=0.0)
    assert generate(model, [torch.tensor([1, 2])], max_new_tokens=0)[0].numel() == 0


def test_stop_defaults_to_the_checkpoints_eos_ids(tmp_path):
    """stop=None: the model config's eos ids (from config.json / generation_config.json); [] never stops early.
    on_token sees each step's new tokens, 0 for sequences already stopped."""
    import dataclasses

    _, path = make_hf(tmp_path, "gqa")
    model = zoo.load(path, attn="sdpa")
    prompts = _prompts(300)
    free = generate(model, prompts, max_new_tokens=10, stop=[])
    eos = int(free[0][2])
    model.config = dataclasses.replace(model.config, eos_token_ids=(eos,))
    assert model.eos_token_ids == (eos,)
    steps = []
    got = generate(model, prompts, max_new_tokens=10, on_token=lambda t: steps.append(t.clone()))
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(model, prompts, max_new_tokens=10, stop=[eos])]
    assert got[0].tolist() == free[0][:3].tolist()
    per_step = torch.stack(steps, dim=1)  # [n, steps]
    for i, tokens in enumerate(got):
        assert per_step[i, : len(tokens)].tolist() == tokens.tolist()
        assert not per_step[i, len(tokens):].any()
    assert len(generate(model, prompts[:1], max_new_tokens=10, stop=[])[0]) == 10


# ---- the command line: python -m zoo.generate CKPT --prompt ... | --chat ----


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The debug preset with random weights, saved with the bundled tokenizer (its ChatML template)."""
    from recipes.data.tokenizer_choice import ASSETS

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    zoo.save(zoo.load("debug"), path, tokenizer_from=ASSETS)
    return path


def _expected_text(path, ids: list[int], max_new: int) -> str:
    """What the CLI should print for a prompt of `ids`: the greedy answer, stop tokens left out, and a newline."""
    from zoo.io.config import generation_sampling
    from zoo.io.tokenizer import Tokenizer

    tok = Tokenizer(path)
    model = zoo.load(path, dtype=torch.float32)
    stop = tok.stop_ids()
    penalty = generation_sampling(path).get("repetition_penalty", 1.0)  # the CLI applies the checkpoint's
    tokens = generate(model, [torch.tensor(ids)], max_new_tokens=max_new, stop=stop,
                      repetition_penalty=penalty).pop(0).tolist()
    return tok.decode([t for t in tokens if t not in stop]) + "\n"


def test_cli_prompt_prints_the_continuation(tiny_checkpoint, capsys):
    from zoo.generate.cli import main
    from zoo.io.tokenizer import Tokenizer

    assert main([str(tiny_checkpoint), "--prompt", "Return the list", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    tok = Tokenizer(tiny_checkpoint)
    want = _expected_text(tiny_checkpoint, tok.encode("Return the list"), 12)
    assert capsys.readouterr().out == "Return the list" + want  # the prompt, then its continuation


def test_cli_chat_answers_each_line_with_the_conversation_so_far(tiny_checkpoint, capsys):
    import io

    from zoo.generate.cli import main
    from zoo.io.tokenizer import Tokenizer, render

    stdin = io.StringIO("What is a tuple?\n\nAnd a list?\n")
    assert main([str(tiny_checkpoint), "--chat", "--max-new-tokens", "6", "--temperature", "0"], stdin=stdin) == 0
    out = capsys.readouterr().out
    tok = Tokenizer(tiny_checkpoint)
    messages, want = [], ""
    for question in ("What is a tuple?", "And a list?"):  # the empty line is skipped
        messages.append({"role": "user", "content": question})
        text = render(messages, "auto", tok, add_generation_prompt=True).text
        assert text.endswith("<|im_start|>assistant\n")
        answer = _expected_text(tiny_checkpoint, tok.encode(text, add_special_tokens=False), 6)
        want += answer
        messages.append({"role": "assistant", "content": answer[:-1]})
    assert out == want


def test_cli_chat_system_message_and_reset(tiny_checkpoint, capsys):
    """--system opens the conversation; a `/reset` line starts it over (the system message kept), so the question
    after it gets the answer a fresh conversation gets."""
    import io

    from zoo.generate.cli import main
    from zoo.io.tokenizer import Tokenizer, render

    stdin = io.StringIO("What is a tuple?\n/reset\nAnd a list?\n")
    argv = [str(tiny_checkpoint), "--chat", "--max-new-tokens", "5", "--temperature", "0", "--system", "Be brief."]
    assert main(argv, stdin=stdin) == 0
    out = capsys.readouterr().out
    tok = Tokenizer(tiny_checkpoint)
    want = []
    for question in ("What is a tuple?", "And a list?"):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        text = render(messages, "auto", tok, add_generation_prompt=True).text
        assert "Be brief." in text
        want.append(_expected_text(tiny_checkpoint, tok.encode(text, add_special_tokens=False), 5))
    assert out == want[0] + "(a new conversation)\n" + want[1]
    assert main([str(tiny_checkpoint), "--prompt", "x", "--system", "s"]) == 2
    assert "apply to --chat only" in capsys.readouterr().err


def test_cli_streams_tokens_as_they_come():
    """Printer writes each token's new text at once; an unfinished UTF-8 character waits for its last byte."""
    import io

    from recipes.data.tokenizer_choice import ASSETS
    from zoo.generate.cli import Printer
    from zoo.io.tokenizer import Tokenizer

    tok = Tokenizer(ASSETS)
    ids = tok.encode("Déjà vu", add_special_tokens=False)
    out = io.StringIO()
    printer = Printer(tok, (1,), out)
    seen = []
    for t in [*ids, 1]:
        printer(torch.tensor([t]))
        seen.append(out.getvalue())
    assert printer.finish() == "Déjà vu" and out.getvalue() == "Déjà vu\n"
    assert all("\ufffd" not in s for s in seen) and len(set(seen)) > 2  # printed piece by piece, never half a char


def test_cli_bad_input_is_one_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from zoo.generate.cli import main

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "zoo.generate", str(tmp_path / "nope"), "--prompt", "hi"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'} is not a directory: expected a "
                                               "checkpoint directory (config.json, *.safetensors and the tokenizer)"]
    no_tok = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_checkpoint, no_tok, ignore=shutil.ignore_patterns("tokenizer*"))
    cases = [
        ([str(no_tok), "--prompt", "hi"], "no tokenizer found: looked for"),
        ([str(tiny_checkpoint)], "one of the arguments --prompt --chat is required"),
        ([str(tiny_checkpoint), "--prompt", "hi", "--top-p", "0"], "top_p"),
        ([str(tiny_checkpoint), "--prompt", "hi", "--dtype", "int8"], "argument --dtype: invalid choice"),
        ([str(tiny_checkpoint), "--prompt", "hi", "--device", "tpu:x"], "--device tpu:x"),
        ([str(tmp_path), "--prompt", "hi"], "no tokenizer found"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)


def test_fixtures_greedy_equals_upstream(tmp_path):
    """From the golden fixtures: Llama against transformers' generate; InternLM2 and OpenELM (upstream remote code,
    their forwards matched to the goldens elsewhere) against decoding without a cache."""
    from conftest import fixture_dir

    src = fixture_dir("llama")
    hf = transformers.LlamaForCausalLM.from_pretrained(src).eval()
    model = zoo.load(src)
    prompts = _prompts(hf.config.vocab_size)
    for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=12, stop=[])):
        assert tokens.tolist() == _hf_greedy(hf, prompt, 12, None)
    for name in ("internlm2", "openelm"):
        model = zoo.load(fixture_dir(name))
        prompts = _prompts(model.config.vocab_size)
        for prompt, tokens in zip(prompts, generate(model, prompts, max_new_tokens=8, stop=[])):
            assert tokens.tolist() == _decode_without_cache(model, prompt, 8, dynamic_ntk=False)


# ---- compile=True: the decode step through torch.compile, whole (fullgraph: a host sync would break it) ----


@pytest.fixture
def aot_eager(monkeypatch):
    """The compiled step traced as on a GPU but run by aot_eager: the same whole graph without inductor's C++ build,
    which costs a quarter minute per model on CPU. The Llama test keeps inductor."""
    import importlib

    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")


def test_compiled_decode_equals_eager_llama_gqa():
    """inductor on CPU: greedy tokens equal the eager path's, with a stop id ending one sequence early, and with
    stop ids ending all (the compiled path checks every 8 steps); calls of the same shapes do not recompile."""
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200)
    model = _random(Llama, cfg)
    prompts = _prompts(200)
    eager = generate(model, prompts, max_new_tokens=8, compile=False)
    stop = int(eager[0][2])
    eager_stop = generate(model, prompts, max_new_tokens=8, stop=[stop], compile=False)
    assert [t.tolist() for t in generate(model, prompts, max_new_tokens=8, compile=True)] == \
        [t.tolist() for t in eager]
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, max_new_tokens=8, stop=[stop], compile=True)
    assert [t.tolist() for t in got] == [t.tolist() for t in eager_stop] and len(got[0]) == 3
    every = [int(t[1]) for t in eager]  # each sequence stops by its second token; the host learns it at step 8
    got = generate(model, prompts, max_new_tokens=20, stop=every, compile=True)
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(model, prompts, max_new_tokens=20, stop=every)]
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile (the capacity is rounded up to 256 either way)
    assert model.attend is zoo.get_attention("sdpa")


def test_compiled_decode_internlm2_dynamic_ntk(aot_eager):
    """The per-step RoPE base (from the current length) computed on the device inside the compiled step: the
    prompts start below, at and past max_position_embeddings; tokens equal eager and upstream's rule."""
    cfg = InternLM2Config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=200,
                          rope_scaling={"type": "dynamic", "factor": 2.0}, max_seq_len=8)
    model = _random(InternLM2, cfg)
    prompts = _prompts(200)
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, max_new_tokens=10, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # it was compiled, not left to eager
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(model, prompts, max_new_tokens=10)]
    for prompt, tokens in zip(prompts, got):
        assert tokens.tolist() == _decode_without_cache(model, prompt, 10, dynamic_ntk=True)


def test_compiled_decode_openelm(aot_eager):
    cfg = OpenELMConfig(dim=64, n_layers=3, head_dim=16, n_heads=(4, 8, 4), n_kv_heads=(2, 4, 1),
                        ffn_dim=(96, 128, 64), qkv_multipliers=(), ffn_multipliers=(), vocab_size=200)
    model = _random(OpenELM, cfg)
    prompts = _prompts(200)
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, max_new_tokens=8, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs
    assert [t.tolist() for t in got] == [t.tolist() for t in generate(model, prompts, max_new_tokens=8)]


def test_compiled_decode_batch_sizes_share_a_graph(aot_eager):
    """After a second batch size the compiled step is shape-generic in n: a third and fourth compile nothing (a
    compilation per batch size would also hit torch.compile's recompile limit, an error under fullgraph)."""
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, ffn_dim=48, vocab_size=100)
    model = _random(Llama, cfg)
    graphs = []
    for lens in ([5], [5, 3], [2, 7, 4], [1, 1, 1, 9]):
        prompts = _prompts(100, lens)
        got = generate(model, prompts, max_new_tokens=4, compile=True)
        assert [t.tolist() for t in got] == [t.tolist() for t in generate(model, prompts, max_new_tokens=4)]
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[3] == graphs[2] == graphs[1]
