"""What the engine needs from a drafter."""

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence

import mlx.core as mx


@dataclass
class Proposal:
    """One round of drafts.

    Args:
        tokens: ``[k]`` drafted tokens, in order.
        logits: ``[k, V]`` the drafter's logits at each position (for DSpark
            the Markov-corrected ones), or ``None``.
        log_probs: ``[k, V]`` the log-distribution each draft was sampled
            from, as returned by ``draw``; ``None`` for argmax drafts.
        confidence: ``[k]`` logits of the probability that draft ``i``
            survives verification given that drafts ``0..i-1`` did, or
            ``None`` without a confidence head.
    """

    tokens: mx.array
    logits: Optional[mx.array] = None
    log_probs: Optional[mx.array] = None
    confidence: Optional[mx.array] = None

    def row(self, b: int) -> "Proposal":
        """Row ``b`` of a batch's proposal (arrays with a leading batch axis)."""
        return Proposal(
            *(
                None if (x := getattr(self, f.name)) is None else x[b]
                for f in dataclasses.fields(self)
            )
        )

    def first(self, k: int) -> "Proposal":
        """The first ``k`` drafts of every row of a batch's proposal."""
        return Proposal(
            *(
                None if (x := getattr(self, f.name)) is None else x[:, :k]
                for f in dataclasses.fields(self)
            )
        )


class Drafter(Protocol):
    """A hidden-state drafter, as returned by a ``DrafterKind``'s ``load``.

    The drafter's state lives in the caches it makes, so that a prompt cache
    (target caches followed by drafter caches) holds everything and trims
    together. Between rounds the drafter caches cover exactly the positions
    the target caches cover.
    """

    name: str
    block_size: int  # drafts per round by default
    max_draft_tokens: int  # the most drafts per round it accepts
    taps: Sequence  # target taps it consumes (see targets.base.TargetOutput)
    # Optional: how many drafts to verify (mlx_dspark.confidence.schedulers);
    # without one, make_scheduler's default.
    scheduler: object

    def check_target(self, target) -> None:
        """Raise ``ValueError`` naming the mismatch if the drafter was not
        trained for ``target`` (a ``mlx_dspark.targets.base.Target``)."""

    def make_cache(self) -> list:
        """Fresh drafter state."""

    def commit(
        self, cache: list, hidden: List[mx.array], proposal: Optional[Proposal] = None
    ) -> None:
        """Take in the target's taps (``[1, L, d]`` each, in ``taps`` order)
        for ``L`` new positions whose tokens are now final. ``proposal`` is
        the one this drafter made that the taps' forward verified; ``None``
        when the forward verified no drafts (a prompt, a round without any)."""

    def propose(
        self,
        cache: list,
        anchor: mx.array,
        num_drafts: int,
        draw: Optional[Callable] = None,
        target=None,
        target_cache: Optional[list] = None,
    ) -> Proposal:
        """Draft ``num_drafts`` (>= 1) tokens after ``anchor`` (the last
        emitted token, not yet in the caches). ``draw(logits)`` (``[1, V]``
        logits of one position, called in position order) returns ``(token
        [1], log_probs [1, V] or None)``; ``None`` means argmax. ``target``
        (the ``Target`` that ``check_target`` accepted) and its
        ``target_cache`` are there to read through ``target``'s methods,
        never to write (a drafter that borrows the target's K/V). Must leave
        ``cache`` as it found it."""

    # Optional, for the speculative batch generator: ``propose_batch`` (the
    # arguments of ``propose`` for ``B`` rows: ``anchors`` is ``[B]``,
    # ``draw`` takes and returns ``B`` rows, the proposal's arrays have a
    # leading batch axis), and ``batch_cache``, the class whose ``merge``
    # batches the caches this drafter makes (by default
    # ``batching.cache.BatchRollbackKVCache``).


def check_pairing(refusal: str, problems: List[str], pairs, advice: str) -> None:
    """``check_target``'s verdict: raise ``ValueError`` (``"{refusal}: {the
    problems}. {advice}"``) if there are ``problems`` or the values of a
    ``(what, the drafter's, the target's)`` of ``pairs`` differ; ``what``
    says where the drafter's value goes with ``{}``."""
    problems = problems + [
        f"it expects {what.format(want)}, the target has {have}"
        for what, want, have in pairs
        if want != have
    ]
    if problems:
        raise ValueError(f"{refusal}: " + "; ".join(problems) + f". {advice}")
