"""The speculative batch generator as ``mlx_lm.server`` drives it."""

from ..batching.generator import SpeculativeBatchGenerator
from ..speculative.stats import SpeculativeStats
from .dispatch import local


class ServerBatchGenerator(SpeculativeBatchGenerator):
    """Each request inserted takes its ``num_draft_tokens`` from its
    statistics slot and fills in the slot's statistics. The server inserts a
    request right after putting its generation context on the request's
    response queue, which hands the slot over (``server._ReportingQueue``)."""

    def insert_segments(self, segments, *args, **kwargs):
        slot, local.inserting = getattr(local, "inserting", None), None
        if slot is not None and len(segments) == 1:
            slot.stats = SpeculativeStats(self.drafter.name, self.drafter.block_size)
            kwargs.update(num_draft_tokens=[slot.num_draft_tokens], stats=[slot.stats])
        return super().insert_segments(segments, *args, **kwargs)
