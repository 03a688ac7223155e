"""generate() refuses each careless argument with one ZooError, and sampling leaves torch's global generator as a
caller would expect: drawn from, never reseeded."""

import pytest
import torch

import zoo
from zoo.generate import generate
from zoo.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Llama(CFG, attn="sdpa")
    zoo.core.layers.init_weights(m)
    return m.eval()


PROMPT = [torch.tensor([1, 2, 3])]
CASES = [
    (dict(max_new_tokens=10**12), "KV cache .* needs .* GiB, more than"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 0, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 0, got True"),
    (dict(temperature=float("nan")), "temperature must be 0 .* got nan"),
    (dict(temperature=1e-45), "temperature must be 0 .* got 1e-45"),
    (dict(temperature=float("inf")), "temperature must be 0 .* got inf"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an integer >= 1 or None, got 2.5"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be a number in \\(0, 1\\] or None, got 0.0"),
    (dict(stop="12"), "stop must be a list of token ids in 0..49 .* got '12'"),
    (dict(stop=7), "stop must be a list of token ids .* got 7"),
    (dict(stop=[2**70]), "stop must be a list of token ids"),
    (dict(stop=[-1]), "stop must be a list of token ids"),
    (dict(temperature=1.0, seed=2**64), "seed must be an integer in 0..2\\*\\*64-1 or None"),
    (dict(temperature=1.0, seed=-1), "seed must be an integer in 0..2\\*\\*64-1 or None"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number above 0 \\(1: none\\), got 0.0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number above 0"),
    (dict(repetition_penalty=True), "repetition_penalty must be a finite number above 0"),
    (dict(images=[torch.zeros(3, 8, 8)]), "a llama model takes no images; this pack carries 1"),
]


@pytest.mark.parametrize("kwargs, match", CASES, ids=[str(c[0])[:40] for c in CASES])
def test_a_careless_argument_is_one_zoo_error(model, kwargs, match):
    with pytest.raises(zoo.ZooError, match=match):
        generate(model, PROMPT, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompt", [torch.tensor([1.0 + 2.0j]), torch.tensor([True, False])], ids=["complex", "bool"])
def test_prompts_of_other_dtypes_are_refused(model, prompt):
    with pytest.raises(zoo.ZooError, match="prompt 0 must be a non-empty 1-D tensor of token ids"):
        generate(model, [prompt], max_new_tokens=2)


def test_sampling_without_a_seed_draws_from_the_global_generator_without_reseeding_it(model):
    torch.manual_seed(0)
    generate(model, PROMPT, max_new_tokens=3, temperature=1.0, stop=[])
    after = torch.rand(4)
    torch.manual_seed(0)
    generate(model, PROMPT, max_new_tokens=3, temperature=1.0, stop=[])
    assert torch.equal(torch.rand(4), after)  # reproducible: nothing reseeded the generator from the clock
    torch.manual_seed(0)
    untouched = torch.rand(4)
    assert not torch.equal(untouched, after)  # and the draws did advance it, as any sampling does


def test_a_seed_gives_the_same_tokens_whatever_the_global_state(model):
    torch.manual_seed(1)
    a = generate(model, PROMPT, max_new_tokens=6, temperature=1.0, seed=5, stop=[])
    torch.manual_seed(2)
    b = generate(model, PROMPT, max_new_tokens=6, temperature=1.0, seed=5, stop=[])
    assert [t.tolist() for t in a] == [t.tolist() for t in b]
