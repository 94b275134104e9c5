"""What the engine needs from a target model."""

from dataclasses import dataclass
from typing import List, Protocol, Sequence, Union

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
    """A target model wrapped for speculative decoding (see ``TargetAdapter``)."""

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
