"""The one registry of named models: name -> family config, Hugging Face source, published parameter count.

Parameter counts are the totals of the published safetensors checkpoints; tests/test_presets.py builds every
preset on the meta device and checks its count against them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, cast

from zoo.core.contract import DecoderConfig
from zoo.errors import ZooError
from zoo.models import ModelConfig
from zoo.models.clip import CLIPVisionConfig
from zoo.models.deepseek_v3 import DeepseekV3Config
from zoo.models.gemma2 import Gemma2Config
from zoo.models.gemma3 import Gemma3Config
from zoo.models.gemma3_vision import SIGLIP_SO400M_896, Gemma3VisionConfig
from zoo.models.glm4 import GLM4_EOS, GLM4_PAD, Glm4Config
from zoo.models.glm4_moe import Glm4MoeConfig
from zoo.models.gpt_oss import GptOssConfig
from zoo.models.internlm2 import InternLM2Config
from zoo.models.llama import LlamaConfig
from zoo.models.llava import ORIGINAL_IMAGE_TOKEN, LlavaConfig
from zoo.models.mistral import MistralConfig
from zoo.models.mixtral import MixtralConfig
from zoo.models.olmo2 import Olmo2Config
from zoo.models.openelm import OpenELMConfig
from zoo.models.phi3 import Phi3Config
from zoo.models.qwen2 import Qwen2Config
from zoo.models.qwen2_5_vl import Qwen25VLConfig
from zoo.models.qwen2_moe import Qwen2MoeConfig
from zoo.models.qwen3 import Qwen3Config
from zoo.models.qwen3_5 import Qwen3_5Config
from zoo.models.qwen3_5_moe import Qwen3_5MoeConfig
from zoo.models.qwen3_5_moe_vl import Qwen3_5MoeVLConfig
from zoo.models.qwen3_5_vl import Qwen3_5VLConfig
from zoo.models.qwen3_moe import Qwen3MoeConfig
from zoo.models.qwen3_next import Qwen3NextConfig
from zoo.models.qwen3_vl import QWEN3_VISION, Qwen3VLConfig
from zoo.models.qwen_vision import QwenVisionConfig


@dataclass(frozen=True)
class Preset:
    family: str
    config: ModelConfig
    hf_source: str | None  # Hugging Face repo id of the published weights (None for zoo's own)
    params: int  # published parameter count
    active_params: int | None = None  # a Mixture-of-Experts model's parameters per token (top-k experts)


def active_params(config: ModelConfig, params: int) -> int | None:
    """A Mixture-of-Experts config's parameters per token: all but the experts a token does not run (each expert
    3 x dim x width: gate, up, down; plus its biases where the config says so, `expert_params`). None for a dense
    config."""
    c: Any = getattr(config, "language", config)  # a multimodal model's experts are its language model's
    sparse = getattr(c, "sparse_layers", None)
    if sparse is None:
        return None
    per_expert = c.expert_params() if hasattr(c, "expert_params") else 3 * c.dim * c.expert_ffn_dim
    return params - sum(sparse()) * (c.n_experts - c.top_k) * per_expert


PRESETS: dict[str, Preset] = {}


def register(name: str, family: str, config: ModelConfig, hf_source: str | None, params: int) -> None:
    """Add a named preset (a name may be registered once)."""
    if name in PRESETS:
        raise ValueError(f"preset {name!r} is registered twice")
    PRESETS[name] = Preset(family, config, hf_source, params, active_params(config, params))


def get_preset(name: str) -> Preset:
    """The preset of that name, in any case (`qwen3-0.6B`), or a ZooError naming the five closest known names."""
    if name.lower() not in PRESETS:
        close = difflib.get_close_matches(name.lower(), PRESETS, n=5, cutoff=0.0)
        raise ZooError(f"unknown preset {name!r} (`python -m zoo presets` lists all {len(PRESETS)}); closest first: "
                       f"{', '.join(close)}")
    return PRESETS[name.lower()]


def list_presets() -> list[dict[str, Any]]:
    """Every preset as {name, family, params, hf_source}, and active_params (per token) for a Mixture-of-Experts
    one, in registration order (what `python -m zoo presets` prints)."""
    return [{"name": n, "family": p.family, "params": p.params, "hf_source": p.hf_source}
            | ({} if p.active_params is None else {"active_params": p.active_params}) for n, p in PRESETS.items()]


# ---- Llama ----

LLAMA2_7B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000)
LLAMA2_13B = LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000)
LLAMA2_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000)
_L3: dict[str, Any] = dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)
LLAMA3_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_L3)
LLAMA3_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_L3)


def _llama31(factor: float) -> dict[str, Any]:
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    return dict(vocab_size=128256, rope_theta=500000.0, max_seq_len=131072, rope_scaling=scaling)


LLAMA31_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **_llama31(8.0))
LLAMA31_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **_llama31(8.0))
LLAMA32_1B = LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
                         tie_embeddings=True, **_llama31(32.0))
LLAMA32_3B = LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192,
                         tie_embeddings=True, **_llama31(32.0))

for _name, _cfg, _base, _chat, _params in [
    ("llama-2-7b", LLAMA2_7B, "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf", 6_738_415_616),
    ("llama-2-13b", LLAMA2_13B, "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf", 13_015_864_320),
    ("llama-2-70b", LLAMA2_70B, "meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf", 68_976_648_192),
    ("llama-3-8b", LLAMA3_8B, "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct", 8_030_261_248),
    ("llama-3-70b", LLAMA3_70B, "meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct",
     70_553_706_496),
    ("llama-3.1-8b", LLAMA31_8B, "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248),
    ("llama-3.1-70b", LLAMA31_70B, "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496),
    ("llama-3.2-1b", LLAMA32_1B, "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct", 1_235_814_400),
    ("llama-3.2-3b", LLAMA32_3B, "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct", 3_212_749_824),
]:
    register(_name, "llama", _cfg, _base, _params)
    register(_name + ("-chat" if _name.startswith("llama-2") else "-instruct"), "llama", _cfg, _chat, _params)

# tiny Llama-3 style model for tests, demos and the built-in recipes (vocab = the bundled tokenizer's)
DEBUG = LlamaConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, vocab_size=2048,
                    rope_theta=10000.0, max_seq_len=2048)
register("debug", "llama", DEBUG, None, 1_262_720)

# ---- Qwen2.5, Qwen3, Mistral ----
# Qwen2.5: the base models of 1.5B and 7B up read 131,072 positions, 0.5B, 3B and every instruct model 32,768
_qwen25: list[tuple[str, dict[str, Any], int, int]] = [
    ("0.5b", dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
                  tie_embeddings=True), 32768, 494_032_768),
    ("1.5b", dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, vocab_size=151936,
                  tie_embeddings=True), 131072, 1_543_714_304),
    ("3b", dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_dim=11008, vocab_size=151936,
                tie_embeddings=True), 32768, 3_085_938_688),
    ("7b", dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064), 131072,
     7_615_616_512),
    ("14b", dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824, vocab_size=152064), 131072,
     14_770_033_664),
    ("32b", dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648, vocab_size=152064), 131072,
     32_763_876_352),
    ("72b", dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=29568, vocab_size=152064), 131072,
     72_706_203_648),
]
for _size, _shape, _base_len, _params in _qwen25:
    _source = f"Qwen/Qwen2.5-{_size.upper()}"
    register(f"qwen2.5-{_size}", "qwen2", Qwen2Config(max_seq_len=_base_len, **_shape), _source, _params)
    register(f"qwen2.5-{_size}-instruct", "qwen2", Qwen2Config(max_seq_len=32768, **_shape), _source + "-Instruct",
             _params)

# Qwen3 (dense): 128-wide heads whatever the width, 40,960 positions; published as one hybrid-thinking model a size
_qwen3: list[tuple[str, dict[str, Any], int]] = [
    ("0.6b", dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True), 596_049_920),
    ("1.7b", dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_embeddings=True),
     1_720_574_976),
    ("4b", dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_embeddings=True), 4_022_468_096),
    ("8b", dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288), 8_190_735_360),
    ("14b", dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408), 14_768_307_200),
    ("32b", dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600), 32_762_123_264),
]
for _size, _shape, _params in _qwen3:
    register(f"qwen3-{_size}", "qwen3", Qwen3Config(head_dim=128, max_seq_len=40960, **_shape),
             f"Qwen/Qwen3-{_size.upper()}", _params)

_M7B: dict[str, Any] = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, norm_eps=1e-5,
                            max_seq_len=32768)
for _name, _mistral, _base, _chat, _params in [
    ("mistral-7b-v0.1", MistralConfig(vocab_size=32000, rope_theta=10000.0, sliding_window=4096, **_M7B),
     "mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1", 7_241_732_096),
    ("mistral-7b-v0.3", MistralConfig(vocab_size=32768, rope_theta=1e6, sliding_window=None, **_M7B),
     "mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3", 7_248_023_552),
    ("mistral-nemo-12b", MistralConfig(dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336,
                                       vocab_size=131072, norm_eps=1e-5, rope_theta=1e6, max_seq_len=1024000,
                                       sliding_window=None),
     "mistralai/Mistral-Nemo-Base-2407", "mistralai/Mistral-Nemo-Instruct-2407", 12_247_782_400),
]:
    register(_name, "mistral", _mistral, _base, _params)
    register(_name + "-instruct", "mistral", _mistral, _chat, _params)

# ---- OLMo 2: full multi-head attention, 100,352-token vocabulary, RoPE base 500,000, 4,096 positions, untied ----
_OLMO2: dict[str, Any] = dict(vocab_size=100352, norm_eps=1e-6, rope_theta=500000.0, max_seq_len=4096)
for _size, _olmo2, _source, _params in [
    ("1b", Olmo2Config(dim=2048, n_layers=16, n_heads=16, ffn_dim=8192, **_OLMO2), "allenai/OLMo-2-0425-1B",
     1_484_916_736),
    ("7b", Olmo2Config(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, **_OLMO2), "allenai/OLMo-2-1124-7B",
     7_298_617_344),
    ("13b", Olmo2Config(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, **_OLMO2), "allenai/OLMo-2-1124-13B",
     13_716_198_400),
]:
    register(f"olmo-2-{_size}", "olmo2", _olmo2, _source, _params)
    register(f"olmo-2-{_size}-instruct", "olmo2", _olmo2, _source + "-Instruct", _params)

# ---- Phi-3 and Phi-4 (one class, Phi3ForCausalLM): fused qkv_proj and gate_up_proj, untied head. Phi-3's 4k models
# attend through a 2,047-token window over a 32,064-token vocabulary; phi-4 has full attention, GQA 40/10 and a
# 100,352-token vocabulary. The 128k models' LongRoPE factors (published in their config.json) are not held here ----
_PHI3_4K: dict[str, Any] = dict(vocab_size=32064, max_seq_len=4096, original_max_seq_len=4096, sliding_window=2047)
for _name, _phi3, _source, _params in [
    ("phi-3-mini-4k-instruct", Phi3Config(dim=3072, n_layers=32, n_heads=32, ffn_dim=8192, **_PHI3_4K),
     "microsoft/Phi-3-mini-4k-instruct", 3_821_079_552),
    ("phi-3-medium-4k-instruct", Phi3Config(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, ffn_dim=17920,
                                            **_PHI3_4K), "microsoft/Phi-3-medium-4k-instruct", 13_960_238_080),
    ("phi-4", Phi3Config(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, ffn_dim=17920, vocab_size=100352,
                         rope_theta=250000.0, max_seq_len=16384, original_max_seq_len=16384),
     "microsoft/phi-4", 14_659_507_200),
]:
    register(_name, "phi3", _phi3, _source, _params)

# ---- GLM-4-0414 (Glm4ForCausalLM): GQA over 2 KV heads of 128, half of each head turned by an interleaved rotary,
# sandwich norms, fused gate_up_proj, untied head, 151,552-token vocabulary, 32,768 positions. Shapes from the
# published config.json (9B: q/k/v biases; 32B: none, as the configs of its fine-tunes carry it); the counts are
# computed from them (matrices, biases, norms: 9.4B and 32.6B as the hub lists) ----
_GLM4: dict[str, Any] = dict(n_kv_heads=2, head_dim=128, vocab_size=151552, norm_eps=1e-5, max_seq_len=32768,
                             eos_token_ids=GLM4_EOS, pad_token_id=GLM4_PAD)
register("glm-4-9b-0414", "glm4", Glm4Config(dim=4096, n_layers=40, n_heads=32, ffn_dim=13696, **_GLM4),
         "THUDM/GLM-4-9B-0414", 9_400_279_040)
register("glm-4-32b-0414", "glm4", Glm4Config(dim=6144, n_layers=61, n_heads=48, ffn_dim=23040, attention_bias=False,
                                              **_GLM4), "THUDM/GLM-4-32B-0414", 32_566_081_536)

# ---- Gemma 2 (Gemma2ForCausalLM): sliding (4,096) and full layers alternating, 256,000 tokens, the head tied,
# scores capped at 50 and logits at 30. Counts computed from the published config.json shapes (hub: 2.61B, 9.24B,
# 27.2B) ----
for _size, _gemma2, _params in [("2b", Gemma2Config(), 2_614_341_888),  # transformers' defaults are the 2B
                                ("9b", Gemma2Config(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, ffn_dim=14336),
                                 9_241_705_984),
                                ("27b", Gemma2Config(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, head_dim=128,
                                                     ffn_dim=36864, query_pre_attn_scalar=144), 27_227_128_320)]:
    for _it in ("", "-it"):  # the pretrained and the instruction-tuned checkpoint share the architecture
        register(f"gemma-2-{_size}{_it}", "gemma2", _gemma2, f"google/gemma-2-{_size}{_it}", _params)

# ---- Gemma 3: 270M and 1B are text models; from 4B up a Gemma3ForConditionalGeneration (gemma3_vision: SigLIP
# So400m at 896 pixels, the projector to 256 soft tokens, the language model) counted whole as the hub does, the
# language model alone as `<name>-text`. 256-wide heads (27B: 128, its softmax scale from query_pre_attn_scalar 168),
# five sliding layers to one global, the head tied ----
_G3_SMALL: dict[str, Any] = dict(vocab_size=262144, sliding_window=512, max_seq_len=32768)
_G3_LONG: dict[str, Any] = dict(vocab_size=262208, sliding_window=1024, max_seq_len=131072,
                                rope_scaling={"rope_type": "linear", "factor": 8.0})
for _size, _gemma3, _base, _params in [
    ("270m", Gemma3Config(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, ffn_dim=2048, **_G3_SMALL),
     "google/gemma-3-270m", 268_098_176),
    ("1b", Gemma3Config(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_dim=6912, **_G3_SMALL),
     "google/gemma-3-1b-pt", 999_885_952),
]:
    register(f"gemma-3-{_size}", "gemma3", _gemma3, _base, _params)
    register(f"gemma-3-{_size}-it", "gemma3", _gemma3, _base.removesuffix("-pt") + "-it", _params)
for _size, _gemma3, _base, _text_params, _params in [
    ("4b", Gemma3Config(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_dim=10240, **_G3_LONG),
     "google/gemma-3-4b-pt", 3_880_263_168, 4_300_079_472),
    ("12b", Gemma3Config(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_dim=15360, **_G3_LONG),
     "google/gemma-3-12b-pt", 11_766_034_176, 12_187_325_040),
    ("27b", Gemma3Config(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=21504,
                         query_pre_attn_scalar=168, **_G3_LONG),
     "google/gemma-3-27b-pt", 27_009_346_304, 27_432_406_640),
]:
    for _name, _source in [(f"gemma-3-{_size}", _base), (f"gemma-3-{_size}-it", _base.removesuffix("-pt") + "-it")]:
        register(_name, "gemma3_vision", Gemma3VisionConfig(vision=SIGLIP_SO400M_896, language=_gemma3), _source,
                 _params)
        register(f"{_name}-text", "gemma3", _gemma3, _source, _text_params)

# ---- Mixture-of-Experts: Qwen3-MoE, Mixtral, Qwen2-MoE. Counts from the published config.json (the checkpoints'
# tensors are exactly the model's); per-token counts are derived (list_presets' active_params) ----
_Q3MOE: dict[str, Any] = dict(vocab_size=151936, head_dim=128, norm_topk_prob=True, max_seq_len=40960,
                              n_experts=128, top_k=8)
for _size, _moe, _params in [
    ("30b-a3b", Qwen3MoeConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, expert_ffn_dim=768,
                               **_Q3MOE), 30_532_122_624),
    ("235b-a22b", Qwen3MoeConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                                 expert_ffn_dim=1536, **_Q3MOE), 235_093_634_560),
]:  # Qwen3-MoE as Qwen3: one hybrid-thinking post-trained model a size, and its base
    register(f"qwen3-{_size}", "qwen3_moe", _moe, f"Qwen/Qwen3-{_size.upper()}", _params)
    register(f"qwen3-{_size}-base", "qwen3_moe", _moe, f"Qwen/Qwen3-{_size.upper()}-Base", _params)

_MIXTRAL: dict[str, Any] = dict(n_kv_heads=8, rope_theta=1e6, n_experts=8, top_k=2)
for _size, _mixtral, _base, _chat, _params in [
    ("8x7b", MixtralConfig(dim=4096, n_layers=32, n_heads=32, expert_ffn_dim=14336, vocab_size=32000,
                           max_seq_len=32768, **_MIXTRAL),
     "mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1", 46_702_792_704),
    ("8x22b", MixtralConfig(dim=6144, n_layers=56, n_heads=48, expert_ffn_dim=16384, vocab_size=32768,
                            max_seq_len=65536, **_MIXTRAL),
     "mistralai/Mixtral-8x22B-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0.1", 140_630_071_296),
]:
    register(f"mixtral-{_size}", "mixtral", _mixtral, _base, _params)
    register(f"mixtral-{_size}-instruct", "mixtral", _mixtral, _chat, _params)

for _name, _q2moe, _base, _chat, _params in [
    ("qwen1.5-moe-a2.7b", Qwen2MoeConfig(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=5632,
                                         expert_ffn_dim=1408, shared_expert_ffn_dim=5632, n_experts=60, top_k=4,
                                         max_seq_len=8192),
     "Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen1.5-MoE-A2.7B-Chat", 14_315_784_192),
    ("qwen2-57b-a14b", Qwen2MoeConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                                      expert_ffn_dim=2560, shared_expert_ffn_dim=20480, n_experts=64, top_k=8,
                                      max_seq_len=131072),
     "Qwen/Qwen2-57B-A14B", "Qwen/Qwen2-57B-A14B-Instruct", 57_408_658_944),
]:
    register(_name, "qwen2_moe", _q2moe, _base, _params)
    register(_name + ("-chat" if _name.startswith("qwen1.5") else "-instruct"), "qwen2_moe", _q2moe, _chat, _params)

_GLM45: dict[str, Any] = dict(head_dim=128, rope_theta=1e6, attention_bias=True, mtp_layers=1, eos_token_ids=GLM4_EOS,
                              pad_token_id=GLM4_PAD)  # GLM-4.5 (Air: transformers' defaults); counts without MTP
register("glm-4.5", "glm4_moe", Glm4MoeConfig(dim=5120, n_layers=92, ffn_dim=12288, n_experts=160, expert_ffn_dim=1536,
                                              routed_scaling=2.5, first_dense=3, qk_norm=True, **_GLM45),
         "zai-org/GLM-4.5", 352_797_814_784)
register("glm-4.5-air", "glm4_moe", Glm4MoeConfig(**_GLM45), "zai-org/GLM-4.5-Air", 106_852_245_504)

# GPT-OSS: the published config.json's shapes (24 layers of 32 experts, 36 of 128). Totals as OpenAI's model card
# (20.91B, 116.83B); its active counts (3.61B, 5.13B) leave out the embedding matrix, which active_params counts
for _size, _layers, _experts, _params in [("20b", 24, 32, 20_914_757_184), ("120b", 36, 128, 116_829_156_672)]:
    register(f"gpt-oss-{_size}", "gpt_oss", GptOssConfig(n_layers=_layers, n_experts=_experts, router_aux_loss_coef=0.9,
             eos_token_ids=(200002,), pad_token_id=199999), f"openai/gpt-oss-{_size}", _params)

# ---- InternLM2 / InternLM2.5 and OpenELM ----


def _internlm2(factor: float, theta: float = 1e6, max_seq_len: int = 32768, **shape: Any) -> InternLM2Config:
    return InternLM2Config(vocab_size=92544, norm_eps=1e-5, rope_theta=theta, max_seq_len=max_seq_len,
                           rope_scaling={"type": "dynamic", "factor": factor}, **shape)


_IL2_1_8B: dict[str, Any] = {"dim": 2048, "n_layers": 24, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 8192}
_IL2_7B: dict[str, Any] = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336}
_IL2_20B: dict[str, Any] = {"dim": 6144, "n_layers": 48, "n_heads": 48, "n_kv_heads": 8, "ffn_dim": 16384}
for _name, _il2, _source, _params in [
    ("internlm2-1_8b", _internlm2(2.0, **_IL2_1_8B), "internlm/internlm2-1_8b", 1_889_110_016),
    ("internlm2-1_8b-chat", _internlm2(2.0, **_IL2_1_8B), "internlm/internlm2-chat-1_8b", 1_889_110_016),
    ("internlm2-7b", _internlm2(2.0, **_IL2_7B), "internlm/internlm2-7b", 7_737_708_544),
    ("internlm2-7b-chat", _internlm2(2.0, **_IL2_7B), "internlm/internlm2-chat-7b", 7_737_708_544),
    ("internlm2-20b", _internlm2(3.0, **_IL2_20B), "internlm/internlm2-20b", 19_861_149_696),
    ("internlm2-20b-chat", _internlm2(3.0, **_IL2_20B), "internlm/internlm2-chat-20b", 19_861_149_696),
    # the 2.5 base model ships a 256K-position, theta 5e7 config; its chat model keeps InternLM2's
    ("internlm2_5-7b", _internlm2(2.0, 5e7, 262144, **_IL2_7B), "internlm/internlm2_5-7b", 7_737_708_544),
    ("internlm2_5-7b-chat", _internlm2(2.0, **_IL2_7B), "internlm/internlm2_5-7b-chat", 7_737_708_544),
]:
    register(_name, "internlm2", _il2, _source, _params)

# OpenELM: per-layer heads and FFN widths are derived from the multipliers in OpenELMConfig, as upstream does
for _name, _source, _dim, _n_layers, _head_dim, _params in [
    ("openelm-270m", "apple/OpenELM-270M", 1280, 16, 64, 271_527_168),
    ("openelm-450m", "apple/OpenELM-450M", 1536, 20, 64, 457_179_136),
    ("openelm-1_1b", "apple/OpenELM-1_1B", 2048, 28, 64, 1_079_891_456),
    ("openelm-3b", "apple/OpenELM-3B", 3072, 36, 128, 3_036_647_424),
]:
    _elm = OpenELMConfig(dim=_dim, n_layers=_n_layers, head_dim=_head_dim, vocab_size=32000, qkv_multipliers=(0.5, 1.0),
                         num_gqa_groups=4, ffn_multipliers=(0.5, 4.0), ffn_dim_divisor=256)
    register(_name, "openelm", _elm, _source, _params)
    register(_name + "-instruct", "openelm", _elm, _source + "-Instruct", _params)

# ---- LLaVA: CLIP ViT-L/14-336 tower (feature layer -2, class token dropped: 576 image tokens) + a zoo LM ----

_VIT_L_336 = CLIPVisionConfig(dim=1024, n_layers=24, n_heads=16, ffn_dim=4096, image_size=336, patch_size=14)


def _llava(family: str, language: DecoderConfig, image_token_id: int) -> LlavaConfig:
    return LlavaConfig(vision=_VIT_L_336, language_family=family, language=language, projector="mlp2x_gelu",
                       feature_layer=-2, feature_select="default", image_token_id=image_token_id)


def _language(name: str) -> DecoderConfig:
    """The config of a language-model preset registered above (what a LLaVA preset builds on)."""
    preset = PRESETS[name]
    if preset.family == "llava":
        raise ValueError(f"preset {name!r} is a LLaVA, not a language model")
    return cast(DecoderConfig, preset.config)


# llava-hf's Vicuna-1.5 language models: Llama-2 shapes, the vocabulary padded to 32064 (<image> = 32000)
_VICUNA: dict[str, Any] = {"vocab_size": 32064, "norm_eps": 1e-5, "max_seq_len": 4096}
_LLAVA_7B = _llava("llama", LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, **_VICUNA),
                   32000)
_LLAVA_13B = _llava("llama", LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, **_VICUNA),
                    32000)
# XTuner's LLaVA-Llama-3 (llava-hf layout): Llama-3-8B-Instruct, vocabulary padded to 128320, <image> = 128257
_LLAVA_L3_8B = _llava("llama", LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                           vocab_size=128320, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192),
                      128257)
for _name, _llava_cfg, _source, _params in [
    ("llava-1.5-7b", _LLAVA_7B, "llava-hf/llava-1.5-7b-hf", 7_063_427_072),
    ("llava-1.5-13b", _LLAVA_13B, "llava-hf/llava-1.5-13b-hf", 13_351_494_656),
    ("llava-llama-3-8b", _LLAVA_L3_8B, "xtuner/llava-llama-3-8b-v1_1-transformers", 8_355_272_704),
    # XTuner's LLaVA-InternLM2 (InternLM2-chat + the same tower and projector; its placeholder is LLaVA's -200)
    ("llava-internlm2-7b", _llava("internlm2", _language("internlm2-7b-chat"), ORIGINAL_IMAGE_TOKEN),
     "xtuner/llava-internlm2-7b", 8_062_195_712),
    ("llava-internlm2-20b", _llava("internlm2", _language("internlm2-20b-chat"), ORIGINAL_IMAGE_TOKEN),
     "xtuner/llava-internlm2-20b", 20_208_709_632),
]:
    register(_name, "llava", _llava_cfg, _source, _params)

# LLaVA-OpenELM: new (no published weights); the source names where its parts start from
for _size in ("270m", "450m", "1_1b", "3b"):
    _lm = PRESETS[f"openelm-{_size}-instruct"]
    _lm_cfg = _language(f"openelm-{_size}-instruct")
    _proj_dim = _lm_cfg.dim
    register(f"llava-openelm-{_size}", "llava", _llava("openelm", _lm_cfg, ORIGINAL_IMAGE_TOKEN),
             f"{_lm.hf_source} + openai/clip-vit-large-patch14-336",
             _lm.params + 303_507_456 + (1024 + 1) * _proj_dim + (_proj_dim + 1) * _proj_dim)

# Qwen3.5 (dense, text): the language models of the published Qwen3_5ForConditionalGeneration checkpoints, 3 Gated
# DeltaNet layers to 1 gated-attention layer, 256-wide attention heads with a quarter rotated (base 1e7), 128-wide
# DeltaNet heads. The counts are computed from the config.json shapes (the language model alone: the checkpoints also
# hold a vision tower and a multi-token-prediction head, which zoo leaves out), not read off the hub.
_QWEN3_5: dict[str, Any] = dict(head_dim=256, vocab_size=248320, rope_theta=1e7, max_seq_len=262144,
                                linear_key_heads=16)
_qwen3_5: list[tuple[str, dict[str, Any], int, bool]] = [
    ("0.8b", dict(dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, ffn_dim=3584, linear_value_heads=16,
                  tie_embeddings=True), 752_393_024, False),
    ("2b", dict(dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, ffn_dim=6144, linear_value_heads=16,
                tie_embeddings=True), 1_881_825_088, True),
    ("4b", dict(dim=2560, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=9216, linear_value_heads=32,
                tie_embeddings=True), 4_205_751_296, True),
    ("9b", dict(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=12288, linear_value_heads=32),
     8_953_803_264, True),
    ("27b", dict(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, ffn_dim=17408, linear_value_heads=48),
     26_895_998_464, False),
]
# The whole Qwen3_5ForConditionalGeneration (qwen3_5_vl: the tower, no DeepStack, its merger, the language model with
# interleaved M-RoPE 11/11/10) is `qwen3.5-<size>`, counted from the published config.json shapes (tower, merger and
# language model; the MTP head left out as zoo leaves it out), and the language model alone `qwen3.5-<size>-text`.
# The towers: 9B's and 27B's 27 blocks of 1152 (Qwen3-VL's default tower); 0.8B's 12 blocks of 768 (12 heads, MLP
# 3072) and 4B's 24 blocks of 1024 (16 heads, MLP 4096), as their config.json's vision_config is quoted by two
# independent public repositories. The 2B stays text-only under its names until its tower's shape is confirmed.
_QWEN3_5_TOWERS: dict[str, dict[str, Any]] = {
    "0.8b": dict(n_layers=12, dim=768, n_heads=12, ffn_dim=3072),
    "4b": dict(n_layers=24, dim=1024, n_heads=16, ffn_dim=4096),
    "9b": {}, "27b": {},
}
_WHOLE_QWEN3_5 = {"0.8b": 852_985_920, "4b": 4_539_265_536, "9b": 9_409_813_744, "27b": 27_356_728_560}
for _size, _shape, _params, _has_base in _qwen3_5:
    for _name, _source in [(f"qwen3.5-{_size}", f"Qwen/Qwen3.5-{_size.upper()}")] + (
            [(f"qwen3.5-{_size}-base", f"Qwen/Qwen3.5-{_size.upper()}-Base")] if _has_base else []):
        if _size not in _WHOLE_QWEN3_5:
            register(_name, "qwen3_5", Qwen3_5Config(**_QWEN3_5, **_shape), _source, _params)
            continue
        _tower = {**QWEN3_VISION, **_QWEN3_5_TOWERS[_size], "deepstack_layers": (), "out_dim": _shape["dim"]}
        register(_name, "qwen3_5_vl", Qwen3_5VLConfig(
            vision=QwenVisionConfig(**_tower),
            language=Qwen3_5Config(**_QWEN3_5, **_shape, mrope_section=(11, 11, 10))), _source, _WHOLE_QWEN3_5[_size])
        register(f"{_name}-text", "qwen3_5", Qwen3_5Config(**_QWEN3_5, **_shape), _source, _params)

# Qwen3.5-MoE (text): the language model of Qwen/Qwen3.5-35B-A3B, Qwen3.5's hybrid layers over 256 experts of 512
# (top 8, renormalised) and a shared expert of 512 in every layer. Its shape is transformers' Qwen3_5MoeTextConfig
# defaults (which that class names as this checkpoint's), with the published rope base 1e7 and 262,144 positions; the
# count is computed from those shapes (the language model alone, no vision tower or MTP head), not read off the hub.
# The 122B-A10B and 397B-A17B are left out until their config.json (linear-attention head counts) is at hand.
# The whole Qwen3_5MoeForConditionalGeneration (qwen3_5_moe_vl) is `qwen3.5-35b-a3b`, its tower taken as Qwen3.5-9B's
# and 27B's (27 blocks of 1152, no DeepStack; not read off this checkpoint's config.json), the language model alone
# `qwen3.5-35b-a3b-text`.
register("qwen3.5-35b-a3b", "qwen3_5_moe_vl", Qwen3_5MoeVLConfig(
    vision=QwenVisionConfig(**{**QWEN3_VISION, "deepstack_layers": (), "out_dim": 2048}),
    language=Qwen3_5MoeConfig(rope_theta=1e7, max_seq_len=262144, mrope_section=(11, 11, 10))),
    "Qwen/Qwen3.5-35B-A3B", 35_107_181_936)
register("qwen3.5-35b-a3b-text", "qwen3_5_moe", Qwen3_5MoeConfig(rope_theta=1e7, max_seq_len=262144),
         "Qwen/Qwen3.5-35B-A3B", 34_660_610_688)

# DeepSeek-V3's architecture (deepseek_v3): multi-head latent attention, first layers dense, then 256 experts of 2048
# (top 8 within the 4 best of 8 groups) and a shared expert. The counts are computed from each published config.json's
# shapes, the model alone: DeepSeek-V3's checkpoints also hold a multi-token-prediction layer (model.layers.61, left
# out on load: the hub's 685B is 671B + its 14B) and FP8 scales; "671B total, 37B activated" as DeepSeek publishes
# them. Kimi K2 (model_type kimi_k2, the same architecture: 64 heads, 384 experts in one group, one dense layer) is
# published as 1T total, 32B activated; Moonlight (a plain q_proj, 64 experts of 1408, top 6, 2 shared) as 16B / 3B
# (15.29B / 2.24B without the embeddings and head, which these counts include).
_YARN_V3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
for _name, _source in (("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
                       ("deepseek-v3-base", "deepseek-ai/DeepSeek-V3-Base")):
    register(_name, "deepseek_v3", DeepseekV3Config(rope_scaling=_YARN_V3, max_seq_len=163840), _source,
             671_026_404_352)
_KIMI: dict[str, Any] = dict(
    n_heads=64, vocab_size=163840, n_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
    routed_scaling_factor=2.827, rope_theta=50000.0, max_seq_len=131072, bos_token_id=163584, eos_token_ids=(163585,),
    rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})
register("kimi-k2", "deepseek_v3", DeepseekV3Config(**_KIMI), "moonshotai/Kimi-K2-Instruct", 1_026_408_209_408)
register("kimi-k2-base", "deepseek_v3", DeepseekV3Config(**_KIMI), "moonshotai/Kimi-K2-Base", 1_026_408_209_408)
register("moonlight-16b-a3b", "deepseek_v3",
         DeepseekV3Config(dim=2048, n_layers=27, n_heads=16, q_lora_rank=None, ffn_dim=11264, vocab_size=163840,
                          n_experts=64, top_k=6, expert_ffn_dim=1408, n_shared_experts=2, n_group=1, topk_group=1,
                          first_k_dense_replace=1, routed_scaling_factor=2.446, rope_theta=50000.0, max_seq_len=8192,
                          norm_eps=1e-5, bos_token_id=163584, eos_token_ids=(163585,)),
         "moonshotai/Moonlight-16B-A3B", 15_960_108_544)
# Qwen2.5-VL (Instruct): the native-resolution tower (32 blocks of 1280, full attention in blocks 7, 15,
# 23 and 31; SwiGLU width 3420 on the 3B and 7B, 3456 on the 32B and 72B) and its merger, over Qwen2.5 language models
# with M-RoPE (sections 16/24/24, base 1e6); the published preprocessor's 3136..12845056 pixels an image. The counts
# are the published safetensors totals (config.json shapes, every tensor counted).
for _size, (_dim, _layers, _heads, _kv, _ffn, _vocab, _tie, _vffn), _params in [
    ("3b", (2048, 36, 16, 2, 11008, 151936, True, 3420), 3_754_622_976),
    ("7b", (3584, 28, 28, 4, 18944, 152064, False, 3420), 8_292_166_656),
    ("32b", (5120, 64, 40, 8, 27648, 152064, False, 3456), 33_452_718_336),
    ("72b", (8192, 80, 64, 8, 29568, 152064, False, 3456), 73_410_777_344),
]:
    register(f"qwen2.5-vl-{_size}", "qwen2_5_vl", Qwen25VLConfig(
        vision=QwenVisionConfig(ffn_dim=_vffn, out_dim=_dim),
        language=Qwen2Config(dim=_dim, n_layers=_layers, n_heads=_heads, n_kv_heads=_kv, ffn_dim=_ffn,
                             vocab_size=_vocab, norm_eps=1e-6, rope_theta=1e6, max_seq_len=128000,
                             tie_embeddings=_tie, mrope_section=(16, 24, 24))),
        f"Qwen/Qwen2.5-VL-{_size.upper()}-Instruct", _params)

# Qwen3-VL (Instruct, dense): Qwen3's language models (base 5e6, 262,144 positions, interleaved M-RoPE 24/20/20)
# under Qwen3-VL's tower (16-pixel patches, a 48 x 48 learned position table; 24 blocks of 1024 with DeepStack from
# blocks 5, 11, 17 on the 2B and 4B, 27 of 1152 from 8, 16, 24 on the 8B and 32B). The counts are the published
# safetensors totals (config.json shapes, every tensor counted).
_Q3VL_SMALL: dict[str, Any] = dict(n_layers=24, dim=1024, ffn_dim=4096, deepstack_layers=(5, 11, 17))
for _size, _tower, (_dim, _layers, _heads, _ffn, _tie), _params in [
    ("2b", _Q3VL_SMALL, (2048, 28, 16, 6144, True), 2_127_532_032),
    ("4b", _Q3VL_SMALL, (2560, 36, 32, 9728, True), 4_437_815_808),
    ("8b", {}, (4096, 36, 32, 12288, False), 8_767_123_696),
    ("32b", {}, (5120, 64, 64, 25600, False), 33_357_390_064),
]:
    register(f"qwen3-vl-{_size}", "qwen3_vl", Qwen3VLConfig(
        vision=QwenVisionConfig(**{**QWEN3_VISION, **_tower, "out_dim": _dim}),
        language=Qwen3Config(dim=_dim, n_layers=_layers, n_heads=_heads, n_kv_heads=8, ffn_dim=_ffn,
                             vocab_size=151936, rope_theta=5e6, max_seq_len=262144, tie_embeddings=_tie,
                             mrope_section=(24, 20, 20))),
        f"Qwen/Qwen3-VL-{_size.upper()}-Instruct", _params)

# Qwen3-Next: Qwen3.5's hybrid over 512 experts of 512 (top 10, renormalised) and a shared expert of 512, the published
# config.json (intermediate_size 5120, unused: no dense layer); count computed from it, the MTP head left out
for _kind in ("instruct", "thinking"):  # no base was published
    register(f"qwen3-next-80b-a3b-{_kind}", "qwen3_next", Qwen3NextConfig(ffn_dim=5120, rope_theta=1e7,
             max_seq_len=262144), f"Qwen/Qwen3-Next-80B-A3B-{_kind.title()}", 79_674_391_296)
