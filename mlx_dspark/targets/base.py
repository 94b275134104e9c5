"""What the engine needs from a target model."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn


# Special taps: the scaled embedding that enters layer 0, and the final-normed
# hidden state that the LM head reads.
EMBEDDING = -1
FINAL = "final"


@dataclass
class TargetOutput:
    """One tapped forward of the target.

    Args:
        logits: ``[1, L, V]``, bit-identical to the model's own forward.
        hidden: The requested taps, in request order, each ``[1, L, d]``.
            Tap ``i >= 0`` is the raw output of decoder layer ``i`` (the
            residual stream after the layer, before the final norm; DeepSpec's
            ``hidden_states[i + 1]``); tap ``EMBEDDING`` (-1) is the embedding
            that enters layer 0; tap ``FINAL`` is the final-normed hidden
            state the LM head reads.
    """

    logits: mx.array
    hidden: List[mx.array]


class Target(Protocol):
    """A target model wrapped for speculative decoding (see ``TargetAdapter``).

    ``embed``, ``kv_donors`` and ``borrowed_kv`` are what a drafter that runs
    on the target's own embeddings and K/V (the Gemma-4 assistant) may ask of
    it; a target no such drafter pairs with may leave them out.
    """

    model: nn.Module
    family: str  # the adapter's name; drafters check it
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    def make_cache(self, max_rollback: int) -> list:
        """Caches that can roll back the newest ``max_rollback`` tokens at any
        context length (the engine trims them with ``trim``)."""

    def __call__(
        self, inputs: mx.array, cache: list, taps: Sequence[Union[int, str]] = ()
    ) -> TargetOutput:
        """Forward ``inputs`` (``[1, L]``) through the model, updating ``cache``."""

    def embed(self, tokens: mx.array) -> mx.array:
        """The embeddings of ``tokens`` as the first layer receives them."""

    def kv_donors(self) -> Dict[str, int]:
        """For each layer type (``"sliding_attention"``, ``"full_attention"``),
        the last layer that owns a K/V cache (the layers after it share it)."""

    def borrowed_kv(
        self, cache: list, layer_type: str, start: int, end: int
    ) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """The keys and values in ``cache`` of ``layer_type``'s K/V donor for
        positions ``[start, end)``: ``(keys, values, mask)``, keys and values
        ``[1, heads, S, head_dim]`` as attention takes them and ``mask``
        (``[1, S]``) the entries that are those positions, or ``None`` when
        all ``S`` are. Entries past the cache's offset that a rolled-back
        forward left count as written until they are overwritten.

        With a speculative batch's caches (``BatchRollbackKVCache``),
        ``start`` and ``end`` are each row's (``[B]``), and the keys and
        values are every row's with a ``[B, 1, 1, S]`` mask; rolled-back
        entries are gone."""
