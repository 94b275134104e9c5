"""The speculative batch generator as ``mlx_lm.server`` drives it."""

import logging
import time

import mlx.core as mx

from ..batching.generator import SpeculativeBatchGenerator
from ..speculative.stats import SpeculativeStats
from .dispatch import local


class ServerBatchGenerator(SpeculativeBatchGenerator):
    """Each request inserted takes its ``num_draft_tokens`` from its
    statistics slot and fills in the slot's statistics. The server inserts a
    request right after putting its generation context on the request's
    response queue, which hands the slot over (``server._ReportingQueue``).

    Rounds are read one by one, not pipelined (``PIPELINE``): over HTTP on an
    H200 at 12B shapes, pipelined rounds served 0.64-0.95x the tokens/s of
    rounds read one by one, even with the server's reads kept off the device
    (BENCHMARKS.md). The server reads every token's log-probability
    (``logprobs[token].item()``); each response's ``logprobs`` holds its own
    token's as read with the round (``ReadLogProbs``), so that read is no
    device operation and synchronisation of its own.

    Every ``LOAD_LOG_SECONDS`` while busy it logs (DEBUG) how the generation
    thread's time split between ``next()`` (rounds, first steps, prefill,
    measuring costs) and the server's own work on the responses between
    calls (detokenizing, streaming, prompt caching), with how many of each
    part and how long each took on average. Rounds are told apart by what
    else they paid for (handing finished requests' caches back, copying
    the caches for rows joined or left; ``generator._round_kind``). Every
    round's time is also split three ways (``round_split``): the host
    building and launching it (with MLX's own waits for the device inside
    the launch), waiting for the device in the read, and reading its
    tokens."""

    LOAD_LOG_SECONDS = 10.0
    PIPELINE = False

    def __init__(self, model, drafter, **kwargs):
        kwargs.setdefault("pipeline", self.PIPELINE)
        super().__init__(model, drafter, **kwargs)
        self._load = self._fresh_load(None)
        self._returned = None  # when next() last returned

    @staticmethod
    def _fresh_load(since):
        return {
            "since": since, "inside": 0.0, "between": 0.0, "calls": 0, "tokens": 0,
            "parts": {}, "counts": {}, "split": [0.0, 0.0, 0.0], "rounds": 0,
        }

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
            load["counts"][kind] = load["counts"].get(kind, 0) + 1
        if self.round_split is not None:
            load["split"] = [a + b for a, b in zip(load["split"], self.round_split)]
            load["rounds"] += 1
        load["since"] = load["since"] or start
        window = end - load["since"]
        if window >= self.LOAD_LOG_SECONDS:
            share = lambda seconds: 100 * seconds / max(window, 1e-9)  # noqa: E731
            parts = ", ".join(
                f"{kind} {share(t):.0f}% ({load['counts'][kind]} x {1000 * t / load['counts'][kind]:.0f} ms)"
                for kind, t in load["parts"].items()
            )
            split = ""
            if load["rounds"]:
                build, wait, read = (1000 * t / load["rounds"] for t in load["split"])
                split = (
                    f"; a round: building {build:.1f} ms, waiting for the device {wait:.1f} ms, "
                    f"reading {read:.1f} ms (mean of {load['rounds']})"
                )
            logging.debug(
                "Batch generator, last %.1f s: %d calls, %d tokens; %.0f%% in next() (%s), "
                "%.0f%% in the server between calls%s",
                window, load["calls"], load["tokens"], share(load["inside"]), parts,
                share(load["between"]), split,
            )
            self._load = self._fresh_load(end)
        return prompt_responses, generation_responses

    def insert_segments(self, segments, *args, **kwargs):
        slot, local.inserting = getattr(local, "inserting", None), None
        if slot is not None and len(segments) == 1:
            slot.stats = SpeculativeStats(self.drafter.name, self.drafter.block_size)
            kwargs.update(num_draft_tokens=[slot.num_draft_tokens], stats=[slot.stats])
        return super().insert_segments(segments, *args, **kwargs)

    def _logprobs(self, token, log_probs, token_log_prob):
        return ReadLogProbs(log_probs, token, token_log_prob)


class ReadLogProbs:
    """A response's ``[V]`` log-probabilities as ``mlx_lm.server`` reads
    them: ``[token]`` (the response's own token) is the value read with the
    round, so reading it waits for nothing on the device; anything else
    (``top_logprobs``) is the array's."""

    def __init__(self, log_probs: mx.array, token: int, token_log_prob: float):
        self.array = log_probs
        self._token = token
        self._value = (token_log_prob, log_probs.dtype)

    def __getitem__(self, index):
        if isinstance(index, int) and index == self._token:
            return mx.array(*self._value)
        return self.array[index]

    def __neg__(self):
        return -self.array
