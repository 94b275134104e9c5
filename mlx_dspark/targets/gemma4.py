"""Gemma-4 targets: mlx-lm's ``gemma4_text.Model`` and the ``gemma4.Model``
wrapper (``model_type`` ``gemma4``/``gemma4_unified``, the layout of the real
``gemma-4-12B-it`` checkpoints), float or MLX-quantized."""

from typing import Sequence

import mlx.core as mx
from mlx_lm.models import gemma4, gemma4_text
from mlx_lm.models.cache import KVCache

from ..batching.cache import BatchRollbackKVCache
from ..cache import SlidingWindowKVCache
from ..plugins import TargetAdapter, hookimpl
from . import multirow
from .base import EMBEDDING, FINAL, TargetOutput


def supports(model) -> bool:
    return isinstance(model, (gemma4_text.Model, gemma4.Model))


class Gemma4Target:
    """A Gemma-4 model instance, tapped; the model's computation is left
    untouched outside its forwards here (where ``multirow`` may route a
    verify's rows)."""

    family = "gemma4"

    def __init__(self, model):
        self.model = model
        self.text = model.language_model if isinstance(model, gemma4.Model) else model
        args = self.text.args
        self.model_type = model.model_type
        self.num_layers = args.num_hidden_layers
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.sliding_window = args.sliding_window

    @property
    def args(self):
        """The text model's ``ModelArgs``."""
        return self.text.args

    def embed(self, tokens: mx.array) -> mx.array:
        """Scaled input embeddings, as the first layer receives them."""
        body = self.text.model
        return body.embed_tokens(tokens) * body.embed_scale

    def kv_donors(self) -> dict:
        """For each layer type, the last layer that owns a K/V cache (the
        layers after it share it); its index is also its cache's index."""
        args = self.text.args
        owners = range(args.num_hidden_layers - args.num_kv_shared_layers)
        return {args.layer_types[i]: i for i in owners}

    def borrowed_kv(self, cache: list, layer_type: str, start: int, end: int):
        donor = cache[self.kv_donors()[layer_type]]
        if isinstance(donor, BatchRollbackKVCache):
            return donor.view(start, end)
        if layer_type == "full_attention":  # a KVCache: position p at index p
            return donor.keys[..., start:end, :], donor.values[..., start:end, :], None
        if not isinstance(donor, SlidingWindowKVCache):
            raise ValueError(
                "A drafter reads the target's sliding-window cache by position; "
                "make the prompt cache with "
                "mlx_dspark.make_prompt_cache(model, drafter)."
            )
        return (*donor.entries(start, end), None)

    def make_cache(self, max_rollback: int) -> list:
        args = self.text.args
        num_caches = args.num_hidden_layers - args.num_kv_shared_layers
        return [
            (
                KVCache()
                if args.layer_types[i] == "full_attention"
                else SlidingWindowKVCache(args.sliding_window, max_rollback)
            )
            for i in range(num_caches)
        ]

    def __call__(
        self, inputs: mx.array, cache: list, taps: Sequence[int] = ()
    ) -> TargetOutput:
        with multirow.verifying():
            return self._forward(inputs, cache, taps)

    def _forward(self, inputs, cache, taps):
        # Gemma4TextModel.__call__ and Model.__call__ of mlx-lm 0.32, step for
        # step (so the logits are bit-identical), keeping the layer outputs.
        lm = self.text
        body = lm.model
        input_embeddings = body.embed_tokens(inputs)
        h = input_embeddings * body.embed_scale

        per_layer_inputs = [None] * len(body.layers)
        if body.hidden_size_per_layer_input:
            projected = body._project_per_layer_inputs(
                h, body._get_per_layer_inputs(inputs, input_embeddings)
            )
            per_layer_inputs = [projected[:, :, i, :] for i in range(len(body.layers))]

        cache = cache + [None] * (len(body.layers) - len(cache))
        masks = body._make_masks(h, cache)
        captured = {EMBEDDING: h} if EMBEDDING in taps else {}
        intermediates = [(None, None)] * len(body.layers)
        for idx, (layer, c, mask, prev_idx, per_layer_input) in enumerate(
            zip(body.layers, cache, masks, body.previous_kvs, per_layer_inputs)
        ):
            kvs, offset = intermediates[prev_idx]
            h, kvs, offset = layer(
                h,
                mask,
                c,
                per_layer_input=per_layer_input,
                shared_kv=kvs,
                offset=offset,
            )
            intermediates[idx] = (kvs, offset)
            if idx in taps:
                captured[idx] = h

        out = body.norm(h)
        captured[FINAL] = out
        if lm.tie_word_embeddings:
            logits = body.embed_tokens.as_linear(out)
        else:
            logits = lm.lm_head(out)
        if lm.final_logit_softcapping is not None:
            logits = gemma4_text.logit_softcap(lm.final_logit_softcapping, logits)
        return TargetOutput(logits=logits, hidden=[captured[t] for t in taps])


@hookimpl
def mlx_dspark_target_adapters():
    return [TargetAdapter(name="gemma4", supports=supports, adapt=Gemma4Target)]
