"""Preference tuning with the shared prompt on policies beyond plain attention: hybrids (Gated DeltaNet layers beside
attention), a pair laid out prompt + chosen + rejected, the two answers starting from the prompt's final recurrent
state and convolution inputs (zoo.core.forks), attention gathering the two documents as for dense policies; and
latent attention (DeepSeek-V3's MLA), whose attention call the same gathering takes.

- the delta rule over a forked pack (pieces two and three levels deep, a prompt crossing the 64-token chunk, pieces
  shorter than the convolution's window, no prompt) equals each path run as a document, outputs and gradients (fp64);
- a tiny Qwen3.5, Qwen3-Next and DeepSeek-V3 policy (tests/test_qwen3_5.py's, test_qwen3_next.py's and
  test_deepseek_v3.py's configs): each pair's chosen and rejected log-prob sums in the shared layout equal the
  two-document layout's (fp32, 1e-5 relative), and every gradient is as close to the fp64 two-document one as the
  fp32 two-document gradient is, or within 1e-4 (fp32 rounding of other chunk boundaries: 4.7e-5 worst seen, the two
  documents' 2.0e-5);
- recipes.dpo on a Qwen3.5 and a DeepSeek-V3 policy (--share-prompt, on by default) logs TRL DPOTrainer's metrics on
  the same pairs;
- a forked pack run without the gathering attention, or cut over sequence-parallel ranks, is refused in one line.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass

import pytest
import torch
from test_dpo import TRL_METRICS, assert_same, trl_step, words, zoo_step

import zoo
from recipes.data.preference import PreferenceData
from recipes.data.tokenizer_choice import ASSETS
from recipes.dpo.losses import COMPLETION, scorer
from recipes.dpo.reference import SharedPromptAttention, prepared
from recipes.engine.processes import Dist
from zoo.core.deltanet import forked_documents, torch_documents
from zoo.core.forks import Forks
from zoo.errors import ZooError
from zoo.io.tokenizer import Tokenizer


@dataclass(eq=False, kw_only=True)
class Forked(zoo.Packed):
    pieces: Forks

    def forks(self) -> Forks:
        return self.pieces


def test_forked_delta_rule_equals_each_path_as_a_document():
    # per document: a prompt over a chunk and two answers; no prompt (two roots); a 2-token prompt (shorter than the
    # convolution's 3 inputs back); 64 + 64 + 1; a chain three deep whose middle piece is 1 token
    lens = (70, 9, 66, 5, 1, 2, 1, 3, 64, 64, 1, 3, 1, 2, 4)
    parents = (-1, 0, 0, -1, -1, -1, 5, 5, -1, 8, 8, -1, 11, 12, 12)
    forks, segments = Forks(lens, parents), [145, 6, 6, 129, 10]
    Hk, Hv, Dk, Dv, K, T = 2, 4, 8, 6, 4, sum(lens)
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv, generator=g, dtype=torch.float64, requires_grad=True)
    beta = torch.rand(T, Hv, generator=g, dtype=torch.float64).requires_grad_()
    decay = (-torch.rand(T, Hv, generator=g, dtype=torch.float64)).requires_grad_()
    conv = torch.randn(mixed.shape[1], K, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    zeros = torch.zeros(T, dtype=torch.long)  # the delta rule reads neither ids nor positions
    packed = Forked(input_ids=zeros, cu_seqlens=cu, position_ids=zeros, max_seqlen=max(segments), pieces=forks)
    out = forked_documents(mixed, conv, beta, decay, packed, Dk, Dv, 64)

    starts = forks.starts()

    def path(i):  # the rows of piece i's path, its document's start to its end
        return (path(parents[i]) if parents[i] >= 0 else []) + list(range(starts[i], starts[i] + lens[i]))

    paths = [path(i) for i in range(len(lens)) if i not in parents]
    rows = torch.tensor([r for p in paths for r in p])
    docs = zoo.pack([torch.zeros(len(p), dtype=torch.long) for p in paths])
    want = torch_documents(mixed[rows], conv, beta[rows], decay[rows], docs, Hk, Dk, Dv, 64)
    first = {}  # each token's output where a path first holds it
    for at, r in enumerate(rows.tolist()):
        first.setdefault(r, at)
    want = want[torch.tensor([first[t] for t in range(T)])]
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (mixed, beta, decay, conv)),
                    torch.autograd.grad((want * w).sum(), (mixed, beta, decay, conv))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def policy_checkpoint(path, family: str, seed: int):
    """A tiny random checkpoint of transformers' Qwen3.5, Qwen3-Next or DeepSeek-V3 (the parity tests' config, over
    the bundled tokenizer's vocabulary), saved with the tokenizer."""
    import _tiny_families
    import transformers

    if family == "deepseek_v3":
        from test_deepseek_v3 import VARIANTS as V3_VARIANTS
        from test_deepseek_v3 import save_deepseek_v3

        save_deepseek_v3(path, seed, **V3_VARIANTS["mla"], vocab_size=2048, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, max_position_embeddings=256)
    else:
        if family == "qwen3_5":
            from test_qwen3_5 import TINY, VARIANTS

            cfg = transformers.Qwen3_5TextConfig(**{**TINY, **VARIANTS["qwen3_5"]})
            cls = transformers.Qwen3_5ForCausalLM
        else:
            from test_qwen3_next import TINY as NEXT_TINY

            cfg, cls = transformers.Qwen3NextConfig(**NEXT_TINY), transformers.Qwen3NextForCausalLM
        cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 2048, 0, 1, 2
        torch.manual_seed(seed)
        _tiny_families.randomize(cls(cfg), seed + 1).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, path / f)
    return path


def pairs_file(path, prompts=((30, 30), (3, 5), (0, 0), (36, 36)), seed=0):
    """Text pairs; the prompts' word counts give one over the 64-token chunk and one of the bos alone (shorter than
    the convolution's window)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for lo, hi in prompts:
            prompt = words(rng, lo, hi) + " " if hi else ""
            f.write(json.dumps({"prompt": prompt, "chosen": words(rng, 4, 12), "rejected": words(rng, 4, 12)}) + "\n")
    return path


def logps_and_grads(path, data, shared: bool, dtype):
    """[pairs, 2] the policy's chosen and rejected completion log-prob sums (by pair index), and the gradients of a
    weighted sum of them."""
    model = zoo.load(str(path), dtype=dtype)
    if shared:
        model.set_attention(SharedPromptAttention(model.attend))
    assert len(data) == 1
    packed, where = prepared(data, 0, Dist())
    cols = scorer(model)(where, packed)
    logps = cols.new_zeros(len(data.pairs), 2).index_copy(0, torch.tensor(data.pairs_in(0)),
                                                          cols[:, COMPLETION].view(-1, 2))
    (logps * torch.arange(1, logps.numel() + 1, dtype=dtype).view(-1, 2)).sum().backward()
    return logps.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "deepseek_v3"])
def test_shared_prompt_equals_two_documents(tmp_path, family):
    path = policy_checkpoint(tmp_path / "policy", family, 0)
    f = pairs_file(tmp_path / "pairs.jsonl")
    tok = Tokenizer(path)
    two, one = (PreferenceData(str(f), tok, 1024, 0, share_prompt=s) for s in (False, True))
    prompts = [len(p.prompt) for p in one.pairs]
    assert max(prompts) > 64 and 1 in prompts and one.pairs == two.pairs, prompts
    assert isinstance(one.in_order(0).forks(), Forks) and two.in_order(0).forks() is None
    truth, truth_grads = logps_and_grads(path, two, False, torch.float64)
    want, want_grads = logps_and_grads(path, two, False, torch.float32)
    have, have_grads = logps_and_grads(path, one, True, torch.float32)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(have.double(), truth, rtol=1e-5, atol=1e-5)
    for name, t in truth_grads.items():
        bound = max(1e-4, ((want_grads[name].double() - t).norm() / t.norm()).item())
        rel = ((have_grads[name].double() - t).norm() / t.norm()).item()
        assert t.norm() > 0 and rel < bound, f"{family} grad {name}: relative error {rel:.2e} (bound {bound:.2e})"


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_policy_equals_trl(tmp_path, capsys, family):
    """recipes.dpo with the shared prompt (the default: it no longer turns itself off for Gated DeltaNet or latent
    attention) on a tiny Qwen3.5 or DeepSeek-V3 policy and a different reference, against TRL's DPOTrainer (padded
    two documents a pair)."""
    policy, ref = (policy_checkpoint(tmp_path / name, family, seed) for name, seed in (("policy", 0), ("ref", 2)))
    data = pairs_file(tmp_path / "pairs.jsonl", prompts=((3, 12),) * 6, seed=1)
    want = trl_step("dpo", policy, ref, data, loss_type="sigmoid", beta=0.1)
    have = zoo_step(tmp_path / "out", policy, data, "--ref-model", str(ref))
    assert "pairs laid out prompt + chosen + rejected" in capsys.readouterr().out
    assert abs(want["rewards/margins"]) > 1e-3  # policy and reference disagree
    assert_same(have, want, (*TRL_METRICS, "logits/chosen", "logits/rejected"), f"{family} shared prompt")


def test_a_forked_pack_is_refused_where_it_cannot_run(tmp_path):
    """Attention without the gathering wrapper would let the rejected answer see the chosen one; a sequence-parallel
    cut would separate what the paths share: both refused in one line."""
    import torch.distributed as dist

    from zoo.parallel.sequence import SequenceParallel

    path = policy_checkpoint(tmp_path / "policy", "qwen3_5", 0)
    data = PreferenceData(str(pairs_file(tmp_path / "pairs.jsonl")), Tokenizer(path), 1024, 0, share_prompt=True)
    packed = data.in_order(0)
    with pytest.raises(ZooError, match="documents fork.*SharedPromptAttention") as e:
        zoo.load(str(path))(packed)
    assert "\n" not in str(e.value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ZooError, match="documents fork.*a cut over ranks would separate"):
            SequenceParallel(mode="ring").shard(packed)
    finally:
        dist.destroy_process_group()
