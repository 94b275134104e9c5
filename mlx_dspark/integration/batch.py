"""The speculative batch generator as ``mlx_lm.server`` drives it."""

import logging
import time

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
    0.64-0.88x the speed of rounds read one by one (BENCHMARKS.md).

    Every ``LOAD_LOG_SECONDS`` while busy it logs (DEBUG) how the generation
    thread's time split between ``next()`` (rounds, first steps, prefill,
    measuring costs) and the server's own work on the responses between
    calls (detokenizing, streaming, prompt caching)."""

    LOAD_LOG_SECONDS = 10.0

    def __init__(self, model, drafter, **kwargs):
        kwargs.setdefault("pipeline", False)
        super().__init__(model, drafter, **kwargs)
        self._load = self._fresh_load(None)
        self._returned = None  # when next() last returned

    @staticmethod
    def _fresh_load(since):
        return {"since": since, "inside": 0.0, "between": 0.0, "calls": 0, "tokens": 0, "parts": {}}

    def next(self):
        load, start = self._load, time.perf_counter()
        if self._returned is not None and start - self._returned < 1.0:
            load["between"] += start - self._returned  # longer: the server was idle
        prompt_responses, generation_responses = super().next()
        self._returned = end = time.perf_counter()
        load["inside"] += end - start
        load["calls"] += 1
        load["tokens"] += len(generation_responses)
        for kind, _, seconds in self.phases:
            load["parts"][kind] = load["parts"].get(kind, 0.0) + seconds
        load["since"] = load["since"] or start
        window = end - load["since"]
        if window >= self.LOAD_LOG_SECONDS:
            share = lambda seconds: 100 * seconds / max(window, 1e-9)  # noqa: E731
            parts = ", ".join(f"{kind} {share(t):.0f}%" for kind, t in load["parts"].items())
            logging.debug(
                "Batch generator, last %.1f s: %d calls, %d tokens; %.0f%% in next() (%s), "
                "%.0f%% in the server between calls",
                window, load["calls"], load["tokens"], share(load["inside"]), parts,
                share(load["between"]),
            )
            self._load = self._fresh_load(end)
        return prompt_responses, generation_responses

    def insert_segments(self, segments, *args, **kwargs):
        slot, local.inserting = getattr(local, "inserting", None), None
        if slot is not None and len(segments) == 1:
            slot.stats = SpeculativeStats(self.drafter.name, self.drafter.block_size)
            kwargs.update(num_draft_tokens=[slot.num_draft_tokens], stats=[slot.stats])
        return super().insert_segments(segments, *args, **kwargs)
