"""The speculative batch generator as ``mlx_lm.server`` drives it."""

from ..batching.generator import SpeculativeBatchGenerator
from ..speculative.stats import SpeculativeStats
from .dispatch import local


class ServerBatchGenerator(SpeculativeBatchGenerator):
    """Each request inserted takes its ``num_draft_tokens`` from its
    statistics slot and fills in the slot's statistics. The server inserts a
    request right after putting its generation context on the request's
    response queue, which hands the slot over (``server._ReportingQueue``).

    Rounds are read one by one, not pipelined: the server reads every token's
    log-probability on the generator's stream (``logprobs[token].item()``),
    and behind a round launched ahead that read waits for the whole round.
    Driven that way on an H200 at 12B shapes, pipelined rounds ran at
    0.64-0.88x the speed of rounds read one by one (BENCHMARKS.md)."""

    def __init__(self, model, drafter, **kwargs):
        kwargs.setdefault("pipeline", False)
        super().__init__(model, drafter, **kwargs)

    def insert_segments(self, segments, *args, **kwargs):
        slot, local.inserting = getattr(local, "inserting", None), None
        if slot is not None and len(segments) == 1:
            slot.stats = SpeculativeStats(self.drafter.name, self.drafter.block_size)
            kwargs.update(num_draft_tokens=[slot.num_draft_tokens], stats=[slot.stats])
        return super().insert_segments(segments, *args, **kwargs)
