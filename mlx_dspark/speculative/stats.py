"""Speculative-decoding statistics, in DeepSpec's definitions."""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class Round:
    """One draft-and-verify round.

    ``start`` is the anchor's position, ``drafts`` every token drafted (up to
    the cap), ``confidence`` their confidence logits (if the drafter has a
    head), ``proposed`` how many were verified, ``accepted`` how many of those
    the target kept, and ``next_token`` the target's own token after them
    (``None`` when an accepted draft was a stop token, which ends the round).
    ``predicted`` is the number of accepted drafts the (calibrated)
    confidences predicted among those verified, ``Σ_{k<=proposed} a_k``.
    """

    start: int
    anchor: int
    drafts: List[int]
    confidence: Optional[List[float]]
    proposed: int
    accepted: int
    next_token: Optional[int]
    predicted: Optional[float] = None

    @property
    def acceptance_length(self) -> int:
        """Tokens this round produced: accepted drafts plus the target's token."""
        return self.accepted + (self.next_token is not None)


@dataclass
class SpeculativeStats:
    drafter: str
    block_size: int
    acceptance_rule: str = "greedy"
    scheduler: str = "fixed"
    history: List[Round] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.history)

    @property
    def drafted(self) -> int:
        """Drafts sent to verification."""
        return sum(r.proposed for r in self.history)

    @property
    def plain_rounds(self) -> int:
        """Rounds that verified no draft (parked by a scheduler, or with no
        draft left to verify under the request's budget)."""
        return sum(r.proposed == 0 for r in self.history)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.history)

    @property
    def predicted(self) -> Optional[float]:
        """Accepted drafts the confidences predicted, over the rounds that
        have a prediction (``None`` without a confidence head)."""
        rounds = [r.predicted for r in self.history if r.predicted is not None]
        return sum(rounds) if rounds else None

    @property
    def acceptance_lengths(self) -> List[int]:
        return [r.acceptance_length for r in self.history]

    @property
    def tau(self) -> float:
        """Mean tokens per round (DeepSpec's τ: the target's token counted)."""
        return sum(self.acceptance_lengths) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> List[Optional[float]]:
        """For each draft position k, the fraction of rounds that verified
        position k in which drafts 0..k were all accepted (DeepSpec's
        ``accept_rate@k``); ``None`` where no round verified position k."""
        rates = []
        longest = max([self.block_size] + [r.proposed for r in self.history])
        for k in range(longest):
            verified = [r for r in self.history if r.proposed > k]
            rates.append(
                sum(r.accepted > k for r in verified) / len(verified)
                if verified
                else None
            )
        return rates

    def as_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "acceptance_rule": self.acceptance_rule,
            "scheduler": self.scheduler,
            "rounds": self.rounds,
            "plain_rounds": self.plain_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "predicted": None if self.predicted is None else round(self.predicted, 2),
            "tau": round(self.tau, 4),
            "acceptance_by_position": [
                None if r is None else round(r, 4) for r in self.acceptance_by_position
            ],
        }

    def summary(self) -> str:
        by_position = " ".join(
            "-" if r is None else f"{r:.2f}" for r in self.acceptance_by_position
        )
        predicted = (
            "" if self.predicted is None else f" ({self.predicted:.1f} predicted)"
        )
        plain = f" ({self.plain_rounds} without drafts)" if self.plain_rounds else ""
        return (
            f"{self.drafter} ({self.acceptance_rule}): {self.rounds} rounds{plain}, "
            f"{self.scheduler} scheduler, {self.accepted}/{self.drafted} drafts "
            f"accepted{predicted}, tau {self.tau:.2f} tokens/round, "
            f"acceptance by position [{by_position}]"
        )
