"""Building blocks shared by DeepSpec's drafter networks."""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .heads import ConfidenceHead, make_markov_head


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


class ContextBlockAttention(nn.Module):
    """Attention of the draft block over the committed context and itself.

    Subclasses define ``queries(x, offset)`` and ``keys_values(x, offset)``
    (projected, normed, rotated, ``[B, heads, L, head_dim]``) and ``scale``.
    Context K/V are written to the cache once, when committed; the block's
    K/V are attended to and then dropped, so only committed context stays
    (DeepSpec's ``crop(start)``). There is no mask: the block sees the whole
    context and itself, in both directions.
    """

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
        B, L, _ = x.shape
        offset = cache.offset
        queries = self.queries(x, offset)
        # A batch cache has rows of different lengths: hide what a row lacks.
        mask = cache.block_mask(L) if hasattr(cache, "block_mask") else None
        keys, values = cache.update_and_fetch(*self.keys_values(x, offset))
        cache.trim(L)
        output = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DrafterModel(nn.Module):
    """DeepSpec's drafter network around a family's decoder layer.

    The target's taps of committed positions go through ``fc`` and
    ``hidden_norm`` into every layer's context K/V; the block
    ``[anchor, mask, ...]`` goes through the layers and the final norm;
    ``lm_head`` (plus the family's logit transform) gives the base logits,
    which the Markov head corrects and the confidence head scores.
    """

    def __init__(self, args, decoder_layer):
        super().__init__()
        self.args = args
        dim = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, dim)
        self.fc = nn.Linear(len(args.target_layer_ids) * dim, dim, bias=False)
        self.hidden_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.layers = [decoder_layer(args) for _ in range(args.num_hidden_layers)]
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
        return self.embed_tokens(tokens)

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
        return self.lm_head(hidden)

    def sanitize(self, weights: dict) -> dict:
        # Non-persistent buffers some exporters still write.
        return {
            k: v
            for k, v in weights.items()
            if "rotary_emb" not in k and not k.endswith("embed_scale")
        }
