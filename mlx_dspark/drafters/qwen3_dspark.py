"""DeepSpec's ``Qwen3DSparkModel``: the DSpark and DFlash drafters for Qwen3.

The same drafter as for Gemma-4 (``gemma4_dspark``) on Qwen3's geometry:
plain embeddings (no sqrt(d) scale), no logit soft-cap, separate K and V
projections with q/k RMSNorm and no V norm, 1/sqrt(head_dim) attention
scaling, standard RoPE, pre-norm SwiGLU layers.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.rope_utils import initialize_rope

from ..checkpoints import SIZE, Field, tensor_shapes
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
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: List[int]
    mask_token_id: int
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    rope_parameters: Optional[Dict] = None
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    markov_rank: int = 0
    markov_head_type: Optional[str] = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    def __post_init__(self):
        # transformers >= 5 nests rope_theta and rope_scaling under rope_parameters.
        if self.rope_parameters:
            if self.rope_theta is None:
                self.rope_theta = self.rope_parameters.get("rope_theta")
            if self.rope_scaling is None:
                self.rope_scaling = self.rope_parameters


class Attention(ContextBlockAttention):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def queries(self, x: mx.array, offset: int) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        return self.rope(self.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)

    def keys_values(self, x: mx.array, offset: int):
        B, L, _ = x.shape
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
        return keys, values.transpose(0, 2, 1, 3)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(DrafterModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, DecoderLayer)


FIELDS = {
    "head_dim": SIZE,
    "rope_theta": Field("positive", required=False, nullable=True),
    "rope_scaling": Field("object", required=False, nullable=True),
    "rope_parameters": Field("object", required=False, nullable=True),
    "hidden_act": Field("string", required=False),
}


def config_problems(config: dict) -> list:
    problems = []
    theta = config.get("rope_theta")
    if theta is None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        problems.append("there is no rope_theta (top level or in rope_parameters)")
    elif problem(theta, "positive"):
        problems.append(f"rope_theta must be a number > 0, got {theta!r}")
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        problems.append(f"hidden_act {activation!r} is not supported")
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
        "qwen3",
        dict(
            confidence_threshold=confidence_threshold,
            scheduler=scheduler,
            calibration=calibration,
            dtype=dtype,
            lazy=lazy,
        ),
    )


KIND = DrafterKind(
    name="deepspec-qwen3",
    architectures=("Qwen3DSparkModel",),
    detect=lambda config: architecture(config) == "Qwen3DSparkModel",
    load=load,
)


@hookimpl
def mlx_dspark_drafter_kinds():
    return [KIND]
