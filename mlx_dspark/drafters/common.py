"""Building blocks shared by DeepSpec's drafter networks."""

import mlx.core as mx
import mlx.nn as nn

from .heads import ConfidenceHead, make_markov_head


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

    def __call__(self, x: mx.array, cache) -> mx.array:
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

    def compute_logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(hidden)

    def sanitize(self, weights: dict) -> dict:
        # Non-persistent buffers some exporters still write.
        return {
            k: v
            for k, v in weights.items()
            if "rotary_emb" not in k and not k.endswith("embed_scale")
        }
