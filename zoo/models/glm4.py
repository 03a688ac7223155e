"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414 and their Z1 reasoning models) over a packed batch (transformers'
Glm4ForCausalLM).

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, N query heads, K KV heads,
H head dim, F FFN dim, V vocab.
Llama's attention with a bias on q, k and v (not o), and three differences the spec declares: the rotary turns the
leading `partial_rotary_factor` of each head (half, by default) with its dims paired interleaved, 2i with 2i + 1
(rope_layout "interleaved"; the checkpoint keeps its own row order); every block is a sandwich, each of attention and
MLP with an RMSNorm before and after it (input_layernorm, post_self_attn_layernorm; post_attention_layernorm,
post_mlp_layernorm), x + norm(f(norm(x))) as Gemma 3; and the checkpoint's MLP holds gate and up in one tensor,
`gate_up_proj` ([gate; up]), declared in the name table (split on load, joined on export). The model is the shared
decoder (zoo.models.decoder); this file holds the config, the Hugging Face names and the conversions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.contract import AttentionSpec, DecoderSpec, LayerSpec, MLPSpec
from zoo.core.layers import Rotary
from zoo.errors import ZooError
from zoo.models.decoder import Decoder
from zoo.models.family import Fused, NameTable, family, number, rename_plans
from zoo.models.llama import LLAMA_POSITIVE, finish_shape, shape_from_hf, shape_to_hf

# transformers' Glm4Config fills these in where config.json has no eos_token_id (or null) / no pad_token_id
GLM4_EOS = (151329, 151336, 151338)
GLM4_PAD = 151329


@dataclass(frozen=True)
class Glm4Config:
    """GLM-4's fields; the defaults are transformers' Glm4Config's (the presets hold the published shapes)."""

    family: ClassVar[str] = "glm4"
    positive: ClassVar[frozenset[str]] = LLAMA_POSITIVE | {"rotary_dim"}
    dim: int = 4096
    n_layers: int = 40
    n_heads: int = 32
    n_kv_heads: int = 2
    head_dim: int = 128
    ffn_dim: int = 13696
    vocab_size: int = 151552
    norm_eps: float = 1.5625e-07
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # the leading dims of each head the rotary turns (head_dim * partial_rotary_factor); 0: half
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    attention_bias: bool = True  # on q, k and v; o has none
    bos_token_id: int | None = field(default=None, compare=False)
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    pad_token_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        finish_shape(self)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim // 2)
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ZooError(f"the rotary must turn an even number of dims up to head_dim ({self.head_dim}); "
                           f"partial_rotary_factor gives {self.rotary_dim}")

    @property
    def rope_scaling(self) -> None:
        """None: no RoPE scaling (config_from_hf refuses one); what shape_to_hf writes."""
        return None

    def decoder_spec(self) -> DecoderSpec:
        attn = AttentionSpec(self.n_heads, self.n_kv_heads, self.head_dim, qkv_bias=self.attention_bias,
                             rope_layout="interleaved")
        layer = LayerSpec(attn, MLPSpec(self.ffn_dim), placement="sandwich")
        return DecoderSpec((layer,) * self.n_layers, {"default": Rotary(self.rotary_dim, self.rope_theta)})


# ---- Hugging Face names and config ----

HF_NAMES: NameTable = [  # (zoo prefix, HF prefix); {i} is the layer index. The sandwich's four norms in block order
    Fused("model.layers.{i}.mlp.gate_up_proj.", ("layers.{i}.mlp.gate_proj.", "layers.{i}.mlp.up_proj.")),
    ("embed.", "model.embed_tokens."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.attn_post_norm.", "model.layers.{i}.post_self_attn_layernorm."),
    ("layers.{i}.mlp_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.mlp.", "model.layers.{i}.mlp."),
    ("layers.{i}.mlp_post_norm.", "model.layers.{i}.post_mlp_layernorm."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


def rotary_from_hf(hf: dict[str, Any], what: str = "GLM-4") -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as transformers reads them (GLM-4 and GLM-4.5): rope_parameters
    (transformers 5; the hub's rope_scaling in its place) before the top-level keys, theta 10,000 and the factor 0.5
    where neither says."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, dict):
            raise ZooError(f"{key} must be an object or null, got {hf[key]!r}")
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ZooError(f"{what} with a {kind!r} RoPE scaling is not supported (expected none)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ZooError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    return number(theta), float(partial)


def config_from_hf(hf: dict[str, Any]) -> Glm4Config:
    theta, partial = rotary_from_hf(hf)
    # transformers' Glm4Config defaults: 2 KV heads, head_dim 128, rms_norm_eps 1.5625e-7, 131,072 positions
    shape = shape_from_hf({**hf, "rope_scaling": None, "rope_parameters": None}, "GLM-4", norm_eps=1.5625e-07,
                          kv_heads=2, head_dim=128, max_positions=131072)
    shape.setdefault("eos_token_ids", GLM4_EOS)
    if "pad_token_id" not in hf:
        shape["pad_token_id"] = GLM4_PAD
    shape.update(rope_theta=theta)
    shape.pop("rope_scaling")
    rotary_dim = int(shape["head_dim"] * partial)  # as transformers rounds it
    if rotary_dim < 2:  # 0 would read as the field's default (half)
        raise ZooError(f"partial_rotary_factor {partial} turns {rotary_dim} of head_dim ({shape['head_dim']}); "
                       f"the rotary needs at least 2")
    return Glm4Config(**shape, rotary_dim=rotary_dim, attention_bias=hf.get("attention_bias", True))


def config_to_hf(cfg: Glm4Config) -> dict[str, Any]:
    # ids zoo does not know are written null (transformers' Glm4Config keeps a null pad; a null eos it reads as
    # GLM4_EOS, which a config read from a GLM-4 checkpoint has anyway)
    return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            **shape_to_hf(cfg, "Glm4ForCausalLM", "glm4"), "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
            "attention_bias": cfg.attention_bias}


plan_from_hf, plan_to_hf = rename_plans(HF_NAMES)

# PEFT has no default LoRA targets for glm4: q and v, as for Llama (separate tensors in GLM-4's checkpoint)
FAMILY = family("glm4", Glm4Config, ("glm4",), build=Decoder, config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, plan_from_hf=plan_from_hf, plan_to_hf=plan_to_hf,
                lora_targets=("q_proj", "v_proj"))
