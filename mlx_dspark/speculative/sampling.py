"""The distributions mlx-lm's samplers draw from.

Rejection sampling needs the target's distribution p, not just a sample from
it. ``make_sampler`` here is mlx-lm's ``make_sampler`` whose sampler also
carries a ``SamplingSpec``: the same settings, from which ``log_probs``
computes what that sampler draws from (mlx-lm's own filters, in its order,
then the temperature). A sampler without a spec (any other callable) is
opaque: the engine then accepts drafts only where they equal the target's
own sample.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
)
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler


@dataclass(frozen=True)
class SamplingSpec:
    """The settings of ``mlx_lm.sample_utils.make_sampler``."""

    temp: float
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: Sequence[int] = ()

    @property
    def reproducible(self) -> bool:
        """Whether ``log_probs`` is the sampler's distribution. XTC draws a
        coin for the whole batch, which no per-row distribution describes."""
        return self.xtc_probability == 0.0

    def log_probs(self, logprobs: mx.array) -> mx.array:
        """Log of the distribution the sampler draws from, given the
        (processed) log-probabilities it is called with; float32."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        scaled = logprobs.astype(mx.float32) * (1.0 / self.temp)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[List[int]] = None,
):
    """``mlx_lm.sample_utils.make_sampler``, with ``.sampling_spec`` on the
    sampler it returns (greedy stays mlx-lm's ``greedy_sampler``)."""
    sampler = mlx_lm_make_sampler(
        temp,
        top_p,
        min_p,
        min_tokens_to_keep,
        top_k=top_k,
        xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold,
        xtc_special_tokens=xtc_special_tokens,
    )
    if sampler is not greedy_sampler:
        sampler.sampling_spec = SamplingSpec(
            temp,
            top_p,
            min_p,
            min_tokens_to_keep,
            top_k,
            xtc_probability,
            xtc_threshold,
            tuple(xtc_special_tokens or ()),
        )
    return sampler
