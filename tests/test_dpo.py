"""recipes.dpo against TRL's own trainers (one step over every pair, a policy and a different reference: the metrics
TRL logs and the gradient norm), the chunked log-prob sums against a plain log_softmax, the data's tokenization and
hostile lines, and an interrupted run resumed against an uninterrupted one."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from recipes import dpo
from recipes.data.preference import Pair, PreferenceData, fit
from recipes.data.tokenizer_choice import ASSETS
from zoo.core import logprobs
from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and dog ran far away quickly slowly under over blue red green sky".split()
TRL_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def write_pairs(path, n=10, seed=0, chat=False):
    """Text pairs whose prompts end in a space (so the prompt's last token merges into the completion's first, the
    case TRL's common-prefix rule exists for), or conversations with a system message."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            if chat:
                row = {"system": "be brief", "prompt": [{"role": "user", "content": words(rng, 3, 9)}],
                       "chosen": [{"role": "assistant", "content": words(rng, 2, 7)}],
                       "rejected": [{"role": "assistant", "content": words(rng, 2, 7)}]}
            else:
                row = {"prompt": words(rng, 3, 12) + " ", "chosen": words(rng, 2, 8),
                       "rejected": words(rng, 2, 8)}
            f.write(json.dumps(row) + "\n")
    return path


def hf_checkpoint(path, seed):
    """A tiny random Llama (the bundled tokenizer's vocabulary) as transformers writes it, weights large enough that
    policy and reference disagree."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, Path(path) / f)
    return Path(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_ckpts")
    return hf_checkpoint(root / "policy", 0), hf_checkpoint(root / "ref", 1)


def zoo_step(out, model, data, *extra):
    """recipes.dpo for one step holding every pair; its metrics row."""
    dpo.main(["--model", str(model), "--data", str(data), "--out", str(out), "--steps", "1", "--seq-len", "128",
              "--batch-tokens", "65536", "--no-progress", "--lr", "1e-9", "--grad-clip", "0", "--device", "cpu",
              *extra])  # fp32 on CPU, also where a GPU would make the default bf16
    return json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[0])


def trl_step(kind, policy, ref, data, **kw):
    """TRL's trainer for one step at learning rate 0 over every pair in one batch, fp32 (TRL defaults to bf16)."""
    import transformers

    trl = pytest.importorskip("trl", reason="TRL (the test extra) is the reference here")
    Dataset = pytest.importorskip("datasets", reason="TRL's trainers take a datasets.Dataset").Dataset

    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    common = dict(output_dir=str(Path(data).parent / f"trl-{kind}"), per_device_train_batch_size=len(rows), max_steps=1,
                  learning_rate=0.0, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0,
                  bf16=False)
    dataset = Dataset.from_list(rows)
    if kind == "dpo":
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(ref)
        trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=trl.DPOConfig(**common, max_length=None, **kw),
                                 train_dataset=dataset, processing_class=tok)
    elif kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(model=model, args=CPOConfig(**common, max_length=512, **kw), train_dataset=dataset,
                             processing_class=tok)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common, max_length=512, **kw), train_dataset=dataset,
                              processing_class=tok)
    trainer.train()
    return trainer.state.log_history[0]


def assert_same(have, want, names, where):
    # 1e-4, relative where a metric is larger than 1 (a grad_norm of 40 carries fp32's rounding of 40)
    bad = [f"{k}: zoo {have[k]!r} TRL {want[k]!r}" for k in names
           if abs(have[k] - want[k]) > 1e-4 * max(1.0, abs(want[k]))]
    assert not bad, f"{where}:\n" + "\n".join(bad)


@pytest.mark.parametrize("loss, kw, flags", [
    ("sigmoid", {"loss_type": "sigmoid", "beta": 0.1}, []),
    ("ipo", {"loss_type": "ipo", "beta": 0.5}, ["--beta", "0.5"]),
    ("robust", {"loss_type": "robust", "beta": 0.2, "label_smoothing": 0.1}, ["--beta", "0.2", "--label-smoothing",
                                                                              "0.1"]),
])
def test_dpo_losses_equal_trl(tmp_path, ckpts, loss, kw, flags):
    policy, ref = ckpts
    data = write_pairs(tmp_path / "pairs.jsonl")
    want = trl_step("dpo", policy, ref, data, **kw)
    have = zoo_step(tmp_path / "out", policy, data, "--loss", loss, "--ref-model", str(ref), *flags)
    assert have["pairs"] == 10
    assert_same(have, want, (*TRL_METRICS, "logits/chosen", "logits/rejected"), loss)


def test_two_document_layout_equals_trl(tmp_path, ckpts):
    """--no-share-prompt: each pair as two documents (the layout sequence parallelism runs), sigmoid and ORPO."""
    policy, ref = ckpts
    data = write_pairs(tmp_path / "pairs.jsonl")
    want = trl_step("dpo", policy, ref, data, loss_type="sigmoid", beta=0.1)
    have = zoo_step(tmp_path / "dpo", policy, data, "--ref-model", str(ref), "--no-share-prompt")
    assert_same(have, want, (*TRL_METRICS, "logits/chosen", "logits/rejected"), "two documents")
    want = trl_step("orpo", policy, None, data, beta=0.1)
    have = zoo_step(tmp_path / "orpo", policy, data, "--loss", "orpo", "--no-share-prompt")
    assert_same(have, want, (*TRL_METRICS, "nll_loss"), "orpo, two documents")


def test_shared_prompt_layout(tmp_path):
    """A pair laid out prompt + chosen + rejected: the rejected tokens' positions restart after the prompt, attention
    gathers prompt + chosen and prompt + rejected, and the targets are those of the two documents (the rejected
    first token predicted from the prompt's last row)."""
    f = write_pairs(tmp_path / "pairs.jsonl", n=6)
    two = PreferenceData(str(f), Tokenizer(ASSETS), 256, 0)
    one = PreferenceData(str(f), Tokenizer(ASSETS), 256, 0, share_prompt=True)
    assert one.pairs == two.pairs and len(one) <= len(two)
    packed, plan = one.in_order(0), one.target_plan(0)
    at = 0
    for k, j in enumerate(one.pairs_in(0)):
        p = one.pairs[j]
        P, C, R = len(p.prompt), len(p.chosen), len(p.rejected)
        seg = slice(at, at + P + C + R)
        assert packed.input_ids[seg].tolist() == p.prompt + p.chosen + p.rejected
        assert packed.position_ids[seg].tolist() == [*range(P + C), *range(P, P + R)]
        chosen, rejected = plan.doc_M == 2 * k, plan.doc_M == 2 * k + 1
        assert plan.targets_M[chosen].tolist() == p.chosen and plan.targets_M[rejected].tolist() == p.rejected
        assert plan.rows_M[rejected][0] == plan.rows_M[chosen][0] == at + P - 1
        at += P + C + R
    expanded = packed.input_ids[packed.expand_E]
    assert torch.equal(expanded, packed.expanded.input_ids)
    assert torch.equal(packed.expanded.input_ids[packed.take_T], packed.input_ids)


def test_conversational_pairs_equal_trl(tmp_path, ckpts):
    """Conversations with a system message, rendered through the checkpoint's chat template."""
    policy, ref = ckpts
    data = write_pairs(tmp_path / "chat.jsonl", chat=True)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    trl_rows = tmp_path / "trl.jsonl"  # TRL takes the system turn inside the prompt
    trl_rows.write_text("".join(json.dumps({"prompt": [{"role": "system", "content": r["system"]}, *r["prompt"]],
                                            "chosen": r["chosen"], "rejected": r["rejected"]}) + "\n" for r in rows))
    want = trl_step("dpo", policy, ref, trl_rows, loss_type="sigmoid", beta=0.1)
    have = zoo_step(tmp_path / "out", policy, data, "--ref-model", str(ref))
    assert_same(have, want, TRL_METRICS, "chat")


def test_simpo_and_orpo_equal_trl(tmp_path, ckpts):
    """CPOTrainer (loss_type simpo, cpo_alpha 0) and ORPOTrainer, from trl.experimental in TRL 1.16. They tokenize
    the older way (prompt and answer apart, bos and eos by id): where the checkpoint's rule puts the bos first (the
    bundled tokenizer's), that is DPOTrainer's tokenization. Their logits/* are means over the padded batch, which
    packing has no analogue of."""
    policy, _ = ckpts
    data = write_pairs(tmp_path / "pairs.jsonl")
    want = trl_step("cpo", policy, None, data, loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5)
    have = zoo_step(tmp_path / "simpo", policy, data, "--loss", "simpo", "--beta", "2.0")
    assert_same(have, want, TRL_METRICS, "simpo")
    want = trl_step("orpo", policy, None, data, beta=0.1)
    have = zoo_step(tmp_path / "orpo", policy, data, "--loss", "orpo")
    assert_same(have, want, (*TRL_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"), "orpo")


def test_lora_reference_is_the_base_and_precompute_is_the_same(tmp_path, ckpts):
    """With LoRA and no --ref-model the reference is the policy with adapters off: at step 1 (B = 0) the policy is
    its reference, so every reward is 0 and the loss log 2; --precompute-ref gives the same step, and a second
    run in that --out reads its table back."""
    policy, _ = ckpts
    data = write_pairs(tmp_path / "pairs.jsonl")
    lora = ["--lora-rank", "4", "--lora-targets", "all-linear"]
    live = zoo_step(tmp_path / "live", policy, data, *lora)
    assert abs(live["loss"] - 0.6931472) < 1e-6 and live["rewards/margins"] == 0
    pre = zoo_step(tmp_path / "pre", policy, data, *lora, "--precompute-ref")
    assert_same(pre, live, TRL_METRICS, "precomputed")
    assert (tmp_path / "pre" / dpo.REF_TABLE).is_file()
    # the table is that of the frozen base: the same as --ref-model naming it
    full = zoo_step(tmp_path / "full", policy, data, "--ref-model", str(policy), "--precompute-ref")
    assert abs(full["loss"] - 0.6931472) < 1e-6
    again = zoo_step(tmp_path / "pre", policy, data, *lora, "--precompute-ref", "--force")
    assert_same(again, live, TRL_METRICS, "table read back")


@pytest.mark.parametrize("precompute", [False, True], ids=["live", "precomputed"])
def test_eval_data(tmp_path, ckpts, precompute):
    """--eval-data: the held-out pairs' loss and metrics after the step, as TRL's eval_ names. Evaluated on the
    training pairs after a step at learning rate 1e-9, they are that step's own (the reference live, or its
    precomputed table)."""
    policy, ref = ckpts
    data = write_pairs(tmp_path / "pairs.jsonl")
    row = zoo_step(tmp_path / "out", policy, data, "--ref-model", str(ref), "--eval-data", str(data),
                   *(["--precompute-ref"] if precompute else []))
    assert_same({k.removeprefix("eval_"): v for k, v in row.items() if k.startswith("eval_")}, row,
                [k for k in TRL_METRICS if k != "grad_norm"], "eval")


def test_logprob_sums_against_log_softmax():
    """Chunks of 4 rows over 3 documents (fp64): sums, counts, the mean-logit sums and both gradients."""
    torch.manual_seed(0)
    T, D, V = 37, 8, 50
    h = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    lens = [10, 12, 15]
    packed = zoo.pack([torch.randint(0, V, (n,)) for n in lens])
    old = logprobs.MIN_ROWS, logprobs.LOGITS_PER_CHUNK
    logprobs.MIN_ROWS, logprobs.LOGITS_PER_CHUNK = 4, {"cpu": 4 * V}
    try:
        logp, count, logit = logprobs.sequence_logprobs(h, w, packed)
    finally:
        logprobs.MIN_ROWS, logprobs.LOGITS_PER_CHUNK = old
    weights = torch.randn(3, dtype=torch.float64)
    grads = torch.autograd.grad((logp * weights).sum(), (h, w))
    logits = h @ w.T
    m = packed.labels != -100
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))[m]
    token = torch.log_softmax(logits, -1)[m].gather(1, packed.labels[m][:, None])[:, 0]
    want = torch.zeros(3, dtype=torch.float64).index_add(0, doc, token)
    want_grads = torch.autograd.grad((want * weights).sum(), (h, w))
    torch.testing.assert_close(logp, want)
    assert count.tolist() == [n - 1 for n in lens]
    torch.testing.assert_close(logit, torch.zeros(3, dtype=torch.float64).index_add(0, doc, logits[m].mean(-1)))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)


def test_tokenization_and_packing(tmp_path):
    """Pairs stay whole in one pack as two documents; only completion tokens are targets; a pack holds several."""
    data_file = write_pairs(tmp_path / "pairs.jsonl", n=20)
    data = PreferenceData(str(data_file), Tokenizer(ASSETS), 128, 0)
    assert data.stats["used"] == 20 and len(data) < 20
    tok = Tokenizer(ASSETS)
    for i in range(len(data)):
        packed = data.in_order(i)
        pairs = data.pairs_in(i)
        assert packed.num_docs == 2 * len(pairs) and packed.num_tokens <= 128
        assert int((packed.labels != -100).sum()) == data.loss_tokens[i]
        for k, j in enumerate(pairs):
            p = data.pairs[j]
            assert p.chosen[-1] == tok.eos_id and p.rejected[-1] == tok.eos_id
            a, b = packed.cu_seqlens[2 * k].item(), packed.cu_seqlens[2 * k + 1].item()
            assert packed.input_ids[a:b].tolist() == p.prompt + p.chosen
    data.spread(len(data.pairs))
    assert len(data) == 20 and sorted(j for b in data.items for j in b) == list(range(20))


def test_hostile_lines(tmp_path):
    tok = Tokenizer(ASSETS)
    good = {"prompt": "a b c ", "chosen": "d e", "rejected": "f g"}
    cases = [({"prompt": "a", "chosen": "b"}, "pairs.jsonl:2: expected"),
             ({"prompt": 3, "chosen": "b", "rejected": "c"}, "pairs.jsonl:2: expected \"prompt\" as a string"),
             ({"prompt": [{"role": "user", "content": "x"}], "chosen": "b", "rejected": "c"},
              "pairs.jsonl:2: expected \"prompt\" as a string"),
             ({"system": "s", "prompt": "a", "chosen": "b", "rejected": "c"}, "pairs.jsonl:2: \"system\"")]
    for row, message in cases:
        f = tmp_path / "pairs.jsonl"
        f.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ZooError, match=message):
            PreferenceData(str(f), tok, 64, 0)
    long_prompt = {"prompt": "the " * 100, "chosen": "cat", "rejected": "dog"}
    f.write_text("\n".join(json.dumps(r) for r in (
        good, {**good, "chosen": ""}, {**good, "rejected": good["chosen"]}, long_prompt,
        {"prompt": "a ", "chosen": "the " * 80, "rejected": "sky"})) + "\n")
    data = PreferenceData(str(f), tok, 64, 0)
    counts = [data.stats[k] for k in ("empty", "identical", "dropped", "truncated")]
    assert counts == [1, 1, 1, 1]
    assert all(p.num_tokens <= 64 for p in data.pairs)
    with pytest.raises(ZooError, match="no usable preference pairs"):
        f.write_text(json.dumps(long_prompt) + "\n")
        PreferenceData(str(f), tok, 64, 0)
    assert fit(Pair([1] * 10, [2] * 50, [3] * 5), 64) == Pair([1] * 10, [2] * 39, [3] * 5)


def test_cli_errors(tmp_path):
    """Bad options are one line naming the option (in process here; one run checks the exit code 2 and --help)."""
    data = write_pairs(tmp_path / "pairs.jsonl")
    for args, message in [([], "--data is required"),
                          (["--data", str(data), "--loss", "simpo", "--ref-model", str(tmp_path)], "uses no reference"),
                          (["--data", str(data), "--label-smoothing", "0.5"], "below 0.5"),
                          (["--data", str(data), "--ref-model", str(data)], "expected a checkpoint directory")]:
        with pytest.raises(ZooError, match=message):
            dpo.main([*args, "--out", str(tmp_path / "o")])
    run = subprocess.run([sys.executable, "-m", "recipes.dpo", "--out", str(tmp_path / "o")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: --data is required"), run.stderr
    help = subprocess.run([sys.executable, "-m", "recipes.dpo", "--help"], cwd=ROOT, capture_output=True, text=True)
    for flag in ("--model", "--data", "--loss", "--beta", "--ref-model", "--precompute-ref", "--share-prompt",
                 "--lora-rank", "--qlora", "--sp", "--dp", "--resume", "--export-hf", "--seq-len", "--batch-tokens"):
        assert flag in help.stdout


def test_ctrl_c_then_resume_equals_uninterrupted(tmp_path, capsys):
    """SIGINT after step 1 writes that step's checkpoint (exit 130); --resume reads the precomputed reference back
    and ends where the uninterrupted run does (debug preset, 8 steps)."""
    import os
    import signal

    data = write_pairs(tmp_path / "pairs.jsonl", n=16)
    base = ["--model", "debug", "--data", str(data), "--seq-len", "64", "--batch-tokens", "128", "--no-progress",
            "--save-every", "0", "--lr", "1e-3", "--precompute-ref", "--steps", "8", "--device", "cpu"]
    dpo.main([*base, "--out", str(tmp_path / "a")])
    cmd = [sys.executable, "-m", "recipes.dpo", *base, "--out", str(tmp_path / "b")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step"):
            break
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted at step" in stdout and (tmp_path / "b" / dpo.REF_TABLE).is_file()
    capsys.readouterr()
    dpo.main([*base, "--out", str(tmp_path / "b"), "--resume"])
    assert "reference log-probs read from" in capsys.readouterr().out
    rows = [[json.loads(line) for line in (tmp_path / o / "metrics.jsonl").read_text().splitlines()] for o in "ab"]
    assert [r["step"] for r in rows[1]] == list(range(1, 9))
    for a, b in zip(*rows):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["rewards/margins"] - b["rewards/margins"]) < 1e-6
    assert rows[0][-1]["rewards/margins"] != 0  # the policy moved away from its reference


@pytest.mark.parametrize("sequence", [False, True], ids=["template", "sequence"])
def test_text_gets_the_special_tokens_transformers_adds(tmp_path, sequence):
    """A tokenizer.json whose post-processor adds <s> before and </s> after a text (alone, or inside a Sequence as
    Llama 3's): text pairs are encoded as transformers' tokenizer(text) encodes them."""
    import transformers

    from recipes.data.preference import Encoder

    raw = json.loads((ASSETS / "tokenizer.json").read_text())
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                                   "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}}
    raw["post_processor"] = {"type": "Sequence", "processors": [template]} if sequence else template
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    shutil.copy(ASSETS / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "the cat sat on a mat "
    assert Encoder(Tokenizer(tmp_path), "auto").text(text) == hf(text)["input_ids"]
    assert hf(text)["input_ids"][0] == 0 and hf(text)["input_ids"][-1] == 1


def test_where_the_shared_prompt_cannot_run(monkeypatch):
    """A mixer that does not follow the layout would carry the chosen answer into the rejected one, and a dynamically
    scaled RoPE reads a document's length: the two-document layout is used there, and under --sp. Hybrids (Gated
    DeltaNet beside attention) and latent attention (DeepSeek-V3) run it: tests/test_dpo_hybrid.py."""
    from recipes.dpo import reference
    from recipes.engine.config import parse
    from recipes.engine.processes import Dist
    from zoo.core.contract import AttentionSpec, GatedDeltaNetSpec

    def reason(*argv):
        return dpo.no_shared_prompt(parse(dpo.DPOConfig, ["--data", "x", *argv]), Dist())

    assert reason("--model", "debug") is None
    assert reason("--model", "qwen3.5-0.8b-text") is None and reason("--model", "qwen3-next-80b-a3b-instruct") is None
    assert reason("--model", "deepseek-v3") is None
    assert "--compile" in reason("--model", "debug", "--compile")
    # a mixer the layout does not know (here latent attention, were it not among them) is named
    monkeypatch.setattr(reference, "SHARES_PROMPT", (AttentionSpec, GatedDeltaNetSpec))
    assert "has MLA layers, which the shared-prompt layout does not run" in reason("--model", "deepseek-v3")


def test_moe_policy_adds_the_router_aux_loss_as_trl(tmp_path):
    """A Mixture-of-Experts policy (Qwen3-MoE): the preference loss plus router_aux_loss_coef x transformers' router
    aux loss over the pairs' tokens, as TRL's DPOTrainer adds it (output_router_logits); pairs as two documents, the
    batch TRL runs, in one pack (the term is per pack, as a step's packs are separate forwards). The loss, the
    gradient norm and TRL's aux_loss metric agree."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                      router_aux_loss_coef=0.5, output_router_logits=False,
                                      max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = transformers.Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.normal_(1.0, 0.1)
        model.save_pretrained(tmp_path / f"m{seed}")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ASSETS / f, tmp_path / f"m{seed}" / f)
        paths.append(tmp_path / f"m{seed}")
    data = write_pairs(tmp_path / "pairs.jsonl", n=6)
    want = trl_step("dpo", paths[0], paths[1], data, loss_type="sigmoid", beta=0.1)
    have = zoo_step(tmp_path / "dpo", paths[0], data, "--ref-model", str(paths[1]), "--no-share-prompt",
                    "--seq-len", "512")
    assert want["aux_loss"] > 0.5  # the term is there, not a rounding of the preference loss
    assert_same(have, want, (*TRL_METRICS, "aux_loss"), "MoE policy")
