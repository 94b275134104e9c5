"""DeepSpec's ``Gemma4DSparkModel``: the DSpark and DFlash drafters for Gemma-4.

A few Gemma-4 layers whose queries are the draft block ``[anchor, mask, ...]``
and whose keys/values are the block plus the target's hidden states of every
committed position (projected by ``fc`` and ``hidden_norm``). All layers use
the target's global attention geometry (``global_head_dim``, proportional
RoPE, K = V when ``attention_k_eq_v``) without a mask: the block attends to
the whole context and to itself bidirectionally.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.gemma4_text import geglu, logit_softcap
from mlx_lm.models.rope_utils import initialize_rope

from ..checkpoints import FLAG, NULLABLE_SIZE, SIZE, Field, tensor_shapes
from ..plugins import DrafterKind, architecture, hookimpl
from ..validation import problem
from .common import ContextBlockAttention, DrafterModel
from .deepspec import load_deepspec, validate_config


@dataclass
class ModelArgs(BaseModelArgs):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    global_head_dim: int
    vocab_size: int
    rope_parameters: Dict
    block_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: Optional[float] = None
    max_position_embeddings: int = 131072
    hidden_activation: str = "gelu_pytorch_tanh"
    markov_rank: int = 0
    markov_head_type: Optional[str] = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False


class Attention(ContextBlockAttention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = args.global_head_dim
        self.k_eq_v = args.attention_k_eq_v
        self.n_kv_heads = (
            args.num_global_key_value_heads if self.k_eq_v else args.num_key_value_heads
        )
        self.eps = args.rms_norm_eps
        self.scale = 1.0  # q_norm and k_norm stand in for 1/sqrt(head_dim)
        bias = args.attention_bias

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)

        rope = args.rope_parameters["full_attention"]
        self.rope = initialize_rope(
            dims=self.head_dim,
            base=rope["rope_theta"],
            traditional=False,
            scaling_config=rope,
            max_position_embeddings=args.max_position_embeddings,
        )

    def queries(self, x: mx.array, offset: int) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        return self.rope(self.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)

    def keys_values(self, x: mx.array, offset: int):
        B, L, _ = x.shape
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        values = keys
        if not self.k_eq_v:
            values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
        values = mx.fast.rms_norm(values, None, self.eps).transpose(0, 2, 1, 3)
        return keys, values


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        eps = args.rms_norm_eps
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), cache)
        h = x + self.post_attention_layernorm(h)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(r)
        return h * self.layer_scalar


class Model(DrafterModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderLayer)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        # transformers casts sqrt(d) to the weight dtype first (62.0 in bf16).
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)

    def compute_logits(self, hidden: mx.array) -> mx.array:
        logits = self.lm_head(hidden)
        if self.args.final_logit_softcapping is not None:
            logits = logit_softcap(self.args.final_logit_softcapping, logits)
        return logits


FIELDS = {
    "global_head_dim": SIZE,
    "rope_parameters": Field("object"),
    "num_global_key_value_heads": NULLABLE_SIZE,
    "attention_k_eq_v": FLAG,
    "final_logit_softcapping": Field("positive", required=False, nullable=True),
    "hidden_activation": Field("string", required=False),
}


def config_problems(config: dict) -> list:
    problems = []
    if config.get("attention_k_eq_v") and not config.get("num_global_key_value_heads"):
        problems.append("attention_k_eq_v needs num_global_key_value_heads")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {activation!r} is not supported")
    if config.get("enable_moe_block") or config.get("hidden_size_per_layer_input"):
        problems.append(
            "MoE blocks and per-layer inputs are not part of DSpark drafters"
        )
    full = config["rope_parameters"].get("full_attention")
    if not isinstance(full, dict) or full.get("rope_theta") is None:
        problems.append(
            "rope_parameters has no 'full_attention' entry with a rope_theta"
        )
        return problems
    if problem(full["rope_theta"], "positive"):
        problems.append(f"rope_theta must be a number > 0, got {full['rope_theta']!r}")
    factor = full.get("partial_rotary_factor", 1.0)
    if problem(factor, "number", 0, 1):
        problems.append(f"partial_rotary_factor must be a number in [0, 1], got {factor!r}")
    return problems


def load(
    path: Path,
    config: dict,
    confidence_threshold: float = 0.0,
    scheduler: Optional[str] = None,
    calibration=None,
    dtype=None,
    lazy=False,
):
    validate_config(config, path, tensor_shapes(path), FIELDS, config_problems)
    return load_deepspec(
        path,
        Model,
        ModelArgs,
        "gemma4",
        dict(
            confidence_threshold=confidence_threshold,
            scheduler=scheduler,
            calibration=calibration,
            dtype=dtype,
            lazy=lazy,
        ),
    )


KIND = DrafterKind(
    name="deepspec-gemma4",
    architectures=("Gemma4DSparkModel",),
    detect=lambda config: architecture(config) == "Gemma4DSparkModel",
    load=load,
)


@hookimpl
def mlx_dspark_drafter_kinds():
    return [KIND]
