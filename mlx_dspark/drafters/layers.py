"""The decoder layers and MLP of the drafter networks here (DeepSpec's, for
either family, and the Gemma-4 assistant's), around whatever attention a
network has: the layer hands its extra arguments (a cache, or borrowed K/V
and a position) to the attention."""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.gemma4_text import geglu


class QueryAttention(nn.Module):
    """Attention's query side and output: ``q_proj``, a per-head ``q_norm``
    and RoPE, then ``o_proj`` of the attention. Subclasses make those
    modules, set ``n_heads``, ``head_dim`` and ``scale``, and bring the keys
    and values."""

    def queries(self, x: mx.array, offset) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        return self.rope(self.q_norm(queries).transpose(0, 2, 1, 3), offset=offset)

    def attend(self, queries, keys, values, mask) -> mx.array:
        B, _, L, _ = queries.shape
        output = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args, activation):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Gemma-4's layer: norms before and after the attention and the GELU
    MLP, then ``layer_scalar``."""

    def __init__(self, args, attention: nn.Module):
        super().__init__()
        eps = args.rms_norm_eps
        self.self_attn = attention
        self.mlp = MLP(args, geglu)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, *context) -> mx.array:
        h = self.self_attn(self.input_layernorm(x), *context)
        h = x + self.post_attention_layernorm(h)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        h = h + self.post_feedforward_layernorm(r)
        return h * self.layer_scalar


class PreNormDecoderLayer(nn.Module):
    """Qwen3's layer: a norm before the attention and before the SwiGLU MLP."""

    def __init__(self, args, attention: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = MLP(args, swiglu)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(self, x: mx.array, *context) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), *context)
        return h + self.mlp(self.post_attention_layernorm(h))
