"""How one sequence chooses its tokens: the request's sampler and logits
processors, and the acceptance rule they imply. Shared by the single-stream
engine and the speculative batch, so a round's verdict is written once.

Which drafts are kept depends on the sampler:
- greedy (no sampler, or temperature 0): drafts equal to the target's argmax;
- rejection sampling, for mlx-lm samplers whose distribution is known
  (``speculative.sampling.make_sampler``): drafts are sampled from the drafter's
  distribution under the same settings and accepted with probability
  ``min(1, p/q)``;
- target-sample matching, for any other sampler: drafts equal to the
  target's own sample (mlx-lm's semantics).
All three emit exactly the target's distribution: p is the target's, after
the request's logits processors and sampler settings, as mlx-lm's
``generate_step`` computes it for that position and token history.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from .acceptance import greedy_accept, rejection_accept


def acceptance_rule(sampler) -> str:
    """``"greedy"``, ``"rejection"`` or ``"match"`` for this sampler."""
    if sampler is None or sampler is greedy_sampler:
        return "greedy"
    spec = getattr(sampler, "sampling_spec", None)
    if spec is not None and spec.reproducible:
        return "rejection"
    return "match"


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@dataclass(frozen=True)
class Decoding:
    """One sequence's sampler, logits processors and acceptance rule."""

    sampler: Optional[Callable]
    processors: tuple

    @property
    def rule(self) -> str:
        return acceptance_rule(self.sampler)

    @property
    def plain_greedy(self) -> bool:
        """Greedy without processors: judged for many sequences at once
        (``judge_greedy``)."""
        return self.rule == "greedy" and not self.processors

    @property
    def spec(self):
        return getattr(self.sampler, "sampling_spec", None)

    def log_probs(self, logits: mx.array, context: mx.array) -> mx.array:
        """mlx-lm's ``generate_step`` for one position: the processors see
        every token up to and including the position's input."""
        for processor in self.processors:
            logits = processor(context, logits)
        return log_softmax(logits)

    def next_token(self, log_probs: mx.array) -> mx.array:
        """The target's token from processed log-probabilities ``[1, V]``."""
        if self.rule == "greedy":
            return mx.argmax(log_probs, axis=-1).astype(mx.uint32)
        return self.sampler(log_probs).astype(mx.uint32)

    def draw_for(self, context: mx.array) -> Optional[Callable]:
        """How drafts are drawn: the drafter's logits under the request's
        processors (given the drafts so far) and, when sampling, its sampler
        settings. ``None``: plain argmax."""
        rule = self.rule
        if rule != "rejection" and not self.processors:
            return None
        drafted = []

        def draw(logits):
            history = mx.concatenate([context, *drafted]) if self.processors else None
            log_probs = self.log_probs(logits, history)
            if rule == "rejection":
                log_q = self.spec.log_probs(log_probs)
                token = mx.random.categorical(log_q)
            else:
                log_q, token = None, mx.argmax(log_probs, axis=-1)
            drafted.append(token.astype(mx.uint32))
            return token, log_q

        return draw

    def judge(
        self,
        drafts: mx.array,
        draft_log_probs: Optional[mx.array],
        logits: mx.array,
        context: mx.array,
        num_uniforms: int,
    ) -> Tuple[mx.array, mx.array, mx.array]:
        """The verdict on ``n`` drafts from the target's ``[n + 1, V]``
        logits at ``[anchor, drafts]``, ``context`` being every token up to
        and including the anchor: the verified rows' processed
        log-probabilities, the number of accepted drafts, and ``[n + 1]``
        tokens to emit a prefix of. Rejection sampling draws
        ``num_uniforms`` uniforms whatever ``n``, so that a seed gives the
        same random stream under any schedule."""
        n = drafts.size
        rule = self.rule
        if self.processors:
            verified = mx.concatenate([context, drafts])
            log_probs = mx.concatenate(
                [
                    self.log_probs(logits[k : k + 1], verified[: context.size + k])
                    for k in range(n + 1)
                ]
            )
        else:
            log_probs = log_softmax(logits)
        if rule == "greedy":
            tokens = mx.argmax(log_probs, axis=-1)
        elif rule == "match":
            # One sampler call per row, as generate_step makes them.
            tokens = mx.concatenate(
                [self.sampler(log_probs[k : k + 1]) for k in range(n + 1)]
            )
        else:
            u = mx.random.uniform(shape=(num_uniforms,))[: n + 1]
            accepted, tokens = rejection_accept(
                drafts,
                draft_log_probs[:n] if n else None,
                self.spec.log_probs(log_probs),
                u,
            )
            return log_probs, accepted, tokens
        return log_probs, greedy_accept(drafts, tokens), tokens.astype(mx.uint32)


def judge_greedy(drafts: mx.array, logits: mx.array, counts: mx.array):
    """``Decoding.judge`` for ``S`` plain-greedy sequences at once: ``drafts``
    ``[S, k]`` of which row ``i`` verifies ``counts[i]``, the target's
    ``[S, k + 1, V]`` logits. Returns ``[S, k + 1, V]`` log-probabilities,
    ``[S]`` accepted counts and ``[S, k + 1]`` tokens."""
    log_probs = log_softmax(logits)
    tokens = mx.argmax(log_probs, axis=-1).astype(mx.uint32)
    accepted = mx.minimum(greedy_accept(drafts, tokens), counts)
    return log_probs, accepted, tokens
