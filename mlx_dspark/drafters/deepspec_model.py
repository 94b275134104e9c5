"""DeepSpec's drafter network, for every target family.

A few decoder layers whose queries are the draft block ``[anchor, mask, ...]``
and whose keys/values are the block plus the target's hidden states of every
committed position (projected by ``fc`` and ``hidden_norm``), without a mask:
the block attends to the whole context and to itself bidirectionally. What a
family changes is its ``Geometry``, which its ``ModelArgs`` gives.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import logit_softcap
from mlx_lm.models.rope_utils import initialize_rope

from .heads import ConfidenceHead, make_markov_head
from .layers import QueryAttention


@dataclass
class Geometry:
    """What DeepSpec's drafter takes from its target family.

    Args:
        head_dim, num_key_value_heads: The attention's shape.
        attention_scale: The scale of ``q · k``.
        rope_theta, rope_scaling: ``initialize_rope``'s base and scaling config.
        decoder_layer: ``GemmaDecoderLayer`` or ``PreNormDecoderLayer`` (of
            ``mlx_dspark.drafters.layers``), made as ``decoder_layer(args, attention)``.
        k_eq_v: V is the K projection (there is no ``v_proj``).
        v_norm: V goes through an RMS norm without weight.
        embed_scale: The embeddings are multiplied by ``sqrt(hidden_size)``.
        logit_softcap: Soft-cap of the base logits, if any.
    """

    head_dim: int
    num_key_value_heads: int
    attention_scale: float
    rope_theta: float
    rope_scaling: Optional[dict]
    decoder_layer: Callable
    k_eq_v: bool = False
    v_norm: bool = False
    embed_scale: bool = False
    logit_softcap: Optional[float] = None


@dataclass
class TrainingBlocks:
    """What the training forward hands every layer in place of a cache.

    Args:
        context: ``hidden_norm(fc(features))`` of every position, ``[b, S, d]``.
        anchors: The position of each block's anchor, ``[b, n]``; block ``j``
            sits at positions ``anchors[:, j] + 0..B-1``.
        mask: Which keys each block query sees, ``[b, 1, n·B, S + n·B]``
            (the keys are the context, then every block).
        keep: ``[b, 1, n·B, 1]``, 0 on the rows of dummy blocks.
    """

    context: mx.array
    anchors: mx.array
    mask: mx.array
    keep: mx.array


class Attention(QueryAttention):
    """Attention of the draft block over the committed context and itself.

    Context K/V are written to the cache once, when committed; the block's
    K/V are attended to and then dropped, so only committed context stays
    (DeepSpec's ``crop(start)``). There is no mask: the block sees the whole
    context and itself, in both directions.
    """

    def __init__(self, args):
        super().__init__()
        geometry = args.geometry
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = geometry.num_key_value_heads
        self.head_dim = geometry.head_dim
        self.scale = geometry.attention_scale
        self.k_eq_v = geometry.k_eq_v
        self.v_norm = geometry.v_norm
        self.eps = args.rms_norm_eps
        bias = args.attention_bias

        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=self.eps)
        self.rope = initialize_rope(
            self.head_dim,
            base=geometry.rope_theta,
            traditional=False,
            scaling_config=geometry.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def keys_values(self, x: mx.array, offset):
        B, L, _ = x.shape
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        values = keys
        if not self.k_eq_v:
            values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
        if self.v_norm:
            values = mx.fast.rms_norm(values, None, self.eps)
        return keys, values.transpose(0, 2, 1, 3)

    def add_context(self, context: mx.array, cache) -> None:
        cache.update_and_fetch(*self.keys_values(context, cache.offset))

    def attend_blocks(self, x: mx.array, blocks: TrainingBlocks) -> mx.array:
        """DeepSpec's training attention: ``n`` blocks of ``B`` queries each
        (``x`` is ``[b, n·B, d]``) over the context and the blocks, masked."""
        b, nB, _ = x.shape
        n = blocks.anchors.shape[1]
        offsets = blocks.anchors.reshape(-1)
        # One batch row per block, so each gets its own RoPE offset.
        per_block = x.reshape(b * n, nB // n, -1)

        def unblock(t):
            _, heads, L, dim = t.shape
            t = t.reshape(b, n, heads, L, dim).transpose(0, 2, 1, 3, 4)
            return t.reshape(b, heads, n * L, dim)

        queries = unblock(self.queries(per_block, offsets))
        keys, values = self.keys_values(per_block, offsets)
        context_keys, context_values = self.keys_values(blocks.context, 0)
        keys = mx.concatenate([context_keys, unblock(keys)], axis=2)
        values = mx.concatenate([context_values, unblock(values)], axis=2)
        output = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=blocks.mask
        )
        output = output * blocks.keep.astype(output.dtype)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(b, nB, -1))

    def __call__(self, x: mx.array, cache) -> mx.array:
        if isinstance(cache, TrainingBlocks):
            return self.attend_blocks(x, cache)
        L = x.shape[1]
        offset = cache.offset
        queries = self.queries(x, offset)
        # A batch cache has rows of different lengths: hide what a row lacks.
        mask = cache.block_mask(L) if hasattr(cache, "block_mask") else None
        keys, values = cache.update_and_fetch(*self.keys_values(x, offset))
        cache.trim(L)
        return self.attend(queries, keys, values, mask)


class Model(nn.Module):
    """DeepSpec's drafter network (``Gemma4DSparkModel``, ``Qwen3DSparkModel``).

    The target's taps of committed positions go through ``fc`` and
    ``hidden_norm`` into every layer's context K/V; the block
    ``[anchor, mask, ...]`` goes through the layers and the final norm;
    ``lm_head`` (soft-capped for Gemma-4) gives the base logits, which the
    Markov head corrects and the confidence head scores.

    Args:
        args: A family's ``ModelArgs`` (``gemma4_dspark``, ``qwen3_dspark``):
            the checkpoint's config, and the family's ``geometry``.
    """

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.geometry = geometry = args.geometry
        dim = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        self.fc = nn.Linear(len(args.target_layer_ids) * dim, dim, bias=False)
        self.hidden_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.layers = [
            geometry.decoder_layer(args, Attention(args))
            for _ in range(args.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(dim, args.vocab_size, bias=False)
        self.markov_head = make_markov_head(
            args.markov_head_type, args.vocab_size, args.markov_rank, dim
        )
        self.confidence_head = None
        if args.enable_confidence_head:
            with_markov = args.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(
                dim + (args.markov_rank if with_markov else 0)
            )

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        if self.geometry.embed_scale:
            # transformers casts sqrt(d) to the weight dtype first (62.0 in bf16).
            h = h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)
        return h

    def add_context(self, features: mx.array, cache: list) -> None:
        context = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(context, c)

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        h = self.embed(tokens)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def forward_blocks(self, block_ids, features, anchors, mask, keep) -> mx.array:
        """The training forward (DeepSpec's ``_forward_backbone``): the blocks
        ``block_ids`` (``[b, n·B]``) over the context ``features`` of every
        position (``[b, S, m·d]``); see ``TrainingBlocks``. Returns the final-
        normed hidden states ``[b, n·B, d]``."""
        blocks = TrainingBlocks(
            self.hidden_norm(self.fc(features)), anchors, mask, keep
        )
        h = self.embed(block_ids)
        for layer in self.layers:
            h = layer(h, blocks)
        return self.norm(h)

    def compute_logits(self, hidden: mx.array) -> mx.array:
        logits = self.lm_head(hidden)
        if self.geometry.logit_softcap is not None:
            logits = logit_softcap(self.geometry.logit_softcap, logits)
        return logits

    def sanitize(self, weights: dict) -> dict:
        # Non-persistent buffers some exporters still write.
        return {
            k: v
            for k, v in weights.items()
            if "rotary_emb" not in k and not k.endswith("embed_scale")
        }
