"""Qwen3 targets: mlx-lm's ``qwen3.Model``, float or MLX-quantized."""

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..plugins import TargetAdapter, hookimpl
from . import multirow
from .base import EMBEDDING, FINAL, TargetOutput


def supports(model) -> bool:
    return isinstance(model, qwen3.Model)


class Qwen3Target:
    """A Qwen3 model instance, tapped; the model's computation is left
    untouched outside its forwards here (where ``multirow`` may route a
    verify's rows)."""

    family = "qwen3"

    def __init__(self, model):
        self.model = model
        args = model.args
        self.model_type = model.model_type
        self.num_layers = args.num_hidden_layers
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size

    def make_cache(self, max_rollback: int) -> list:
        # Full attention everywhere: mlx-lm's KVCache rolls back any amount.
        return [KVCache() for _ in range(self.num_layers)]

    def __call__(
        self, inputs: mx.array, cache: list, taps: Sequence[int] = ()
    ) -> TargetOutput:
        with multirow.verifying():
            return self._forward(inputs, cache, taps)

    def _forward(self, inputs, cache, taps):
        # Qwen3Model.__call__ and Model.__call__ of mlx-lm 0.32, keeping the
        # layer outputs (tap -1 is the unscaled embedding).
        body = self.model.model
        h = body.embed_tokens(inputs)
        captured = {EMBEDDING: h} if EMBEDDING in taps else {}
        mask = create_attention_mask(h, cache[0])
        for idx, (layer, c) in enumerate(zip(body.layers, cache)):
            h = layer(h, mask, c)
            if idx in taps:
                captured[idx] = h
        out = body.norm(h)
        captured[FINAL] = out
        if self.model.args.tie_word_embeddings:
            logits = body.embed_tokens.as_linear(out)
        else:
            logits = self.model.lm_head(out)
        return TargetOutput(logits=logits, hidden=[captured[t] for t in taps])


@hookimpl
def mlx_dspark_target_adapters():
    return [TargetAdapter(name="qwen3", supports=supports, adapt=Qwen3Target)]
