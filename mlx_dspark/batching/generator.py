"""Continuous-batching speculative decoding, with the interface of mlx-lm's
``BatchGenerator`` as ``mlx_lm.server`` uses it.

Sequences join between rounds. New prompts are prefilled together (right
padded, each row rolled back past its padding), one chunk per ``next()``;
a prompt's last token is the first step of its generation. Each round then
drafts for every sequence in one drafter call, verifies all of them in one
target forward of ``B x (k + 1)`` rows, and lets each sequence accept its own
prefix under its own rule, sampler, logits processors, stop sequences and
token budget; every row rolls back only its own rejected positions (see
``batching.cache``). ``k`` comes from the batch policy, and may be 0: a round
of plain batched decoding.

Between rounds the target and drafter caches of a sequence hold exactly the
tokens in its ``tokens`` list: every emitted token but the last, which is the
next round's anchor (mlx-lm's ``GenerationBatch`` keeps the same invariant,
so the server's prompt cache stores what it expects).

A finished sequence's caches are handed back as it finishes, but its row
may stay in the batch, verifying no drafts and emitting nothing. Taking
rows out copies every cache of the batch: on a GPU that costs more than a
round (12B shapes, 16 rows on an H200: 50-150 ms on top of a 50 ms round)
while a few more rows in a verify cost next to nothing; on a CPU rows cost
their share of a round. So finished rows leave as in ski rental
(``_finished_rows_leave``): once what they have cost the rounds they rode
along in (at most their share of each round's time) reaches what taking
rows out has cost here (the excess of the rounds after rows left over the
round before), or when no row is left generating, rows join or caches are
packed (which copy caches anyway).
"""

import contextlib
import logging
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.generate import (
    DEFAULT_MAX_TOKENS,
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
    generation_stream,
)
from mlx_lm.generate_utils import BatchCounters, BatchCountersSnapshot, BatchStats
from mlx_lm.sample_utils import greedy_sampler

from ..confidence.calibration import kept_rates, survival
from ..confidence.costs import (
    NEAR_BUCKET_END,
    VERIFIES_MEASURED_PER_ROUND,
    CostProfile,
    RoundCosts,
    RoundTimer,
    depth_bucket,
    profile_path,
)
from ..speculative.decoding import Decoding, judge_greedy
from ..speculative.engine import adapt_target
from ..speculative.stats import Round, SpeculativeStats
from ..validation import check_num_draft_tokens
from .cache import BatchRollbackKVCache
from .policy import Acceptance, BatchPolicy, interpolate

# A parked batch keeps its rounds' taps for the drafter to take in at once
# when it next drafts or the rows change; past this many rounds it takes
# them in anyway, so a batch parked for long does not hold every round's.
MAX_PARKED_ROUNDS = 64

# Taking rows out of the batch costs the median of the last few rounds
# after rows left, less the round before each (``_finished_rows_leave``).
RECENT_COPIES = 5

# A ``next()`` slower than this is logged (DEBUG) with its parts: on a GPU
# the first use of a shape compiles kernels, and a server's stalls show.
SLOW_CALL_SECONDS = 1.0

# The kind of a round whose read time is its own (see ``_round_kind``): the
# policy learns from these rounds only, and the server's load log times
# each kind apart.
TIMED = "rounds"
RESHAPED = "rounds after rows joined or left"
AWAY = "rounds read after the server was away"

@dataclass
class Sequence:
    """One request: its prompt still to process, decoding settings and state."""

    uid: int
    segments: List[List[int]]
    max_tokens: int
    cache: Optional[list]
    tokens: List[int]  # what the caches hold
    decoding: Decoding
    matcher: Any
    num_draft_tokens: int
    stats: SpeculativeStats
    done: int = 0
    total: int = 0
    anchor: Optional[int] = None  # the last emitted token, not yet cached
    emitted: int = 0
    in_flight: int = 0  # tokens a launched, unread round may still emit
    finished: bool = False  # done or removed; its row may stay, idle (see the module docstring)
    # The drafter's recent rates when it joins the batch (``_join``), not
    # when it was inserted: a request queued behind others starts from
    # what their rounds accepted.
    acceptance: Optional[Acceptance] = None

    @property
    def remaining(self) -> int:
        """Tokens left in the budget, counting an unread round as emitting
        all it may (so its drafts never run past the budget)."""
        return self.max_tokens - self.emitted - self.in_flight

    def context(self) -> Optional[mx.array]:
        """Every token up to and including the anchor, for the processors."""
        if not self.decoding.processors:
            return None
        return mx.array(self.tokens + [self.anchor], mx.uint32)


@dataclass
class Rows:
    """Sequences in one batch, and their batched target and drafter caches."""

    sequences: List[Sequence] = field(default_factory=list)
    target_cache: List[BatchRollbackKVCache] = field(default_factory=list)
    draft_cache: List[BatchRollbackKVCache] = field(default_factory=list)
    # Rows joined or left, or caches packed, since the last round launched:
    # copies of every cache that the next round's evaluation does.
    reshaped: bool = False

    def __len__(self):
        return len(self.sequences)

    def caches(self):
        return self.target_cache + self.draft_cache

    def extend(self, other: "Rows") -> None:
        self.reshaped = self.reshaped or bool(other.sequences)
        if not self.sequences:
            self.target_cache, self.draft_cache = other.target_cache, other.draft_cache
        elif other.sequences:
            for a, b in zip(self.caches(), other.caches()):
                a.extend(b)
        self.sequences += other.sequences

    def keep(self, indices: List[int]) -> None:
        if indices == list(range(len(self.sequences))):
            return  # every row stays: filtering would copy every cache
        self.reshaped = True
        self.sequences = [self.sequences[i] for i in indices]
        if not indices:
            self.target_cache, self.draft_cache = [], []
            return
        for c in self.caches():
            c.filter(indices)

    def split(self, indices: List[int]) -> "Rows":
        """The rows at ``indices``, taken out of this batch."""
        if indices == list(range(len(self.sequences))):
            taken = Rows(self.sequences, self.target_cache, self.draft_cache)
            self.keep([])
            return taken
        taken = Rows(
            [self.sequences[i] for i in indices],
            [c.select(indices) for c in self.target_cache],
            [c.select(indices) for c in self.draft_cache],
        )
        self.keep([i for i in range(len(self)) if i not in set(indices)])
        return taken

    def extract(self, i: int) -> list:
        """Row ``i``'s caches holding exactly its sequence's ``tokens``,
        computed now: left lazy, they would hold on to the whole batch's
        buffers in the server's prompt cache, and the request that reuses
        them would pay for their gathers before its first token."""
        end = len(self.sequences[i].tokens)
        caches = [c.extract(i, end) for c in self.caches()]
        mx.async_eval([x for c in caches for x in c.state if isinstance(x, mx.array)])
        return caches

    def trim_rows(self, counts: List[int]) -> None:
        for c in self.caches():
            c.trim_rows(counts)

    def settle(self, counts: List[int], reuse: bool) -> None:
        for c in self.caches():
            c.settle(counts, reuse)

    def wasteful(self, waste: int) -> List[BatchRollbackKVCache]:
        """The caches holding ``waste`` or more unused slots (and at least a
        quarter of their slots): packing them costs O(1) per slot."""
        return [c for c in self.caches() if c.reclaimable() >= max(waste, c.size() // 4)]

    def compact(self, waste: int) -> None:
        wasteful = self.wasteful(waste)
        for c in wasteful:
            c.compact()
        self.reshaped = self.reshaped or bool(wasteful)


class SpeculativeBatchGenerator:
    """mlx-lm's ``BatchGenerator`` (continuous batching) with a hidden-state
    drafter (see the module docstring).

    Args:
        model: The target, as ``mlx_lm.load`` returns it.
        drafter: A drafter that can propose for a batch (``propose_batch``,
            see ``drafters.base.Drafter``).
        num_draft_tokens: Drafts per round at most, by default the drafter's
            block size; ``insert`` can set it per sequence.
        policy: Chooses each round's drafts (``batching.policy``): by
            default ``BatchPolicy``, from round costs measured on this
            machine for this batch size and depth (kept on disk, as the
            cost scheduler's are).
        compact_waste: Slots a row may leave unused (rejected drafts, prompt
            padding) before the caches are packed.
        pipeline: Build each round while the one before it runs on the
            device, when the batch allows it (``_can_overlap``), as mlx-lm's
            ``BatchGenerator`` builds its next step. A caller reading each
            response's ``logprobs`` array as it comes would wait for the
            round ahead on each read (``mlx_lm.server``'s generator reads
            rounds one by one, see ``integration.batch``).
        The rest are ``BatchGenerator``'s.
    """

    def __init__(
        self,
        model,
        drafter,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stop_tokens=None,
        sampler: Optional[Callable] = None,
        logits_processors: Optional[list] = None,
        completion_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        stream=None,
        num_draft_tokens: Optional[int] = None,
        policy=None,
        compact_waste: int = 64,
        pipeline: bool = True,
    ):
        self.model = model
        self.drafter = drafter
        self.target = adapt_target(model, drafter)
        self.max_tokens = max_tokens
        self.sampler = sampler or greedy_sampler
        self.logits_processors = logits_processors or []
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.num_draft_tokens = num_draft_tokens or drafter.block_size
        self.policy = policy or BatchPolicy()
        if getattr(self.policy, "costs", False) is None:
            self.policy.costs = self.measured_costs
        self.compact_waste = compact_waste
        self.pipeline = pipeline
        self._stream = stream or generation_stream
        self._default_stop_sequences = StopSequences(stop_tokens or None)
        self._uid_count = 0
        self._pending = deque()
        self._prefill = Rows()
        self._joining = Rows()  # prefilled, waiting for no round in flight
        self._generation = Rows()
        self._in_flight = None  # a launched round not yet read
        # The generating rows' taps from rounds without drafts, not yet
        # taken in by the drafter (see ``_commit_parked``).
        self._parked_taps = []
        self._counters = BatchCounters()
        self._max_rollback = drafter.max_draft_tokens + 1
        self._windows = [
            c.window if hasattr(c, "window") else None
            for c in self.target.make_cache(self._max_rollback)
        ]
        self._num_draft_caches = len(drafter.make_cache())
        self._cost_profile = None
        self._measuring = 0.0  # seconds spent measuring costs
        self._measured = False  # costs measured since the last round launched
        self._last_read = 0.0  # when the last round was read
        # Ski rental for finished rows: what they cost the rounds they rode
        # along in since rows last left, what taking rows out cost, and the
        # seconds of the last round of its own since rows last joined.
        self._rent = 0.0
        self._copies = deque(maxlen=RECENT_COPIES)
        self._last_round = None
        # The last ``next()``'s parts: (kind, what, seconds), and what its
        # round did besides drafting and verifying (``_round_kind``).
        self.phases = []
        self.round_kind = TIMED
        # The last round read: (seconds the host spent building and launching
        # rounds in that call, the next one too where pipelined, costs
        # measured aside; waiting for the device in the read; the rest of the
        # read), or None.
        self.round_split = None
        # Every sequence's rounds, recent ones weighing more: a joining
        # sequence's first guess of its acceptance.
        self._recent = Acceptance(drafter.max_draft_tokens)

    @property
    def stream(self):
        return self._stream

    def close(self):
        """Lets go of the policy, which may pace the next generator (the
        server's, after a drain): its rounds chosen and not read are this
        one's, and so are the costs it reads."""
        if getattr(self.policy, "costs", None) == self.measured_costs:
            self.policy.costs = None
        if hasattr(self.policy, "restart"):
            self.policy.restart()

    @contextlib.contextmanager
    def stats(self):
        """The work this generator does while the block runs (mlx-lm's
        ``BatchStats``)."""
        stats = BatchStats()
        start = BatchCountersSnapshot(**asdict(self._counters))
        try:
            yield stats
        finally:
            end = BatchCountersSnapshot(**asdict(self._counters))
            stats += BatchCountersSnapshot.between(start, end)

    # -- requests ---------------------------------------------------------

    def insert(self, prompts, max_tokens=None, caches=None, all_tokens=None,
               samplers=None, logits_processors=None, stop_sequences=None,
               num_draft_tokens=None, stats=None):
        return self.insert_segments(
            [[p] for p in prompts], max_tokens, caches, all_tokens, samplers,
            logits_processors, stop_sequences, num_draft_tokens, stats,
        )

    def insert_segments(self, segments, max_tokens=None, caches=None,
                        all_tokens=None, samplers=None, logits_processors=None,
                        stop_sequences=None, num_draft_tokens=None, stats=None):
        """Queue sequences as ``BatchGenerator.insert_segments`` does; also
        per sequence: ``num_draft_tokens`` (``None``: the generator's) and a
        ``SpeculativeStats`` to fill in."""
        n = len(segments)
        options = {
            "max_tokens": max_tokens or [self.max_tokens] * n,
            "caches": caches or [None] * n,
            "all_tokens": all_tokens or [[] for _ in range(n)],
            "samplers": samplers or [None] * n,
            "logits_processors": logits_processors or [self.logits_processors] * n,
            "stop_sequences": stop_sequences or [self._default_stop_sequences] * n,
            "num_draft_tokens": num_draft_tokens or [None] * n,
            "stats": stats or [None] * n,
        }
        for name, values in options.items():
            if len(values) != n:
                raise ValueError(
                    f"Option {name} must have one entry per segment: expected "
                    f"{n}, got {len(values)}."
                )
        sequences = []
        for i, parts in enumerate(segments):
            uid = self._uid_count + i
            parts = [list(p) for p in parts if len(p)]
            if not parts:
                raise ValueError(f"Sequence {uid} has an empty prompt.")
            if options["max_tokens"][i] <= 0:
                raise ValueError(f"Sequence {uid}'s max_tokens must be > 0.")
            drafts = options["num_draft_tokens"][i]
            drafts = check_num_draft_tokens(
                self.num_draft_tokens if drafts is None else drafts, self.drafter
            )
            sampler = options["samplers"][i] or self.sampler
            decoding = Decoding(sampler, tuple(options["logits_processors"][i] or ()))
            stats_i = options["stats"][i] or SpeculativeStats(
                self.drafter.name, self.drafter.block_size
            )
            stats_i.acceptance_rule = decoding.rule
            stats_i.scheduler = self.policy.name
            # The last prompt token is the first step of generation.
            if len(parts[-1]) > 1:
                parts.append(parts[-1][-1:])
                parts[-2] = parts[-2][:-1]
            sequences.append(
                Sequence(
                    uid=uid,
                    segments=parts,
                    max_tokens=options["max_tokens"][i],
                    cache=options["caches"][i],
                    tokens=list(options["all_tokens"][i]),
                    decoding=decoding,
                    matcher=options["stop_sequences"][i].matcher(),
                    num_draft_tokens=drafts,
                    stats=stats_i,
                    total=sum(len(p) for p in parts),
                )
            )
        self._pending.extend(sequences)
        self._uid_count += n
        return [s.uid for s in sequences]

    def _groups(self):
        return (self._generation, self._joining, self._prefill)

    def _where(self, uid):
        for rows in self._groups():
            for i, s in enumerate(rows.sequences):
                if s.uid == uid and not s.finished:
                    return rows, i
        for s in self._pending:
            if s.uid == uid:
                return None, s
        return None, None

    def extract_cache(self, uids):
        """``{uid: (caches, tokens)}``, single-sequence caches holding
        exactly ``tokens``."""
        results = {}
        for uid in uids:
            rows, where = self._where(uid)
            if rows is self._generation:
                self._commit_parked()  # its drafter caches take their taps
            if rows is not None:
                results[uid] = (rows.extract(where), list(rows.sequences[where].tokens))
            elif where is not None:
                results[uid] = (where.cache, list(where.tokens))
        return results

    def remove(self, uids, return_prompt_caches=False):
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        if any(self._where(uid)[0] is self._generation for uid in uids):
            self._commit_parked()  # before the rows change
        uids = set(uids)
        self._pending = deque(s for s in self._pending if s.uid not in uids)
        for rows in self._groups():
            if rows is self._generation and self._in_flight is not None:
                # Its rows ride along, finished, from the round in flight on.
                for s in rows.sequences:
                    s.finished = s.finished or s.uid in uids
                continue
            # A finished row riding along leaves by the rule, with the parked
            # taps taken in first (``_where`` does not find it).
            keep = [i for i, s in enumerate(rows.sequences) if s.finished or s.uid not in uids]
            if len(keep) < len(rows):
                rows.keep(keep)
        return caches

    @property
    def prompt_cache_nbytes(self) -> int:
        total = sum(c.nbytes for s in self._pending for c in (s.cache or ()))
        for rows in self._groups():
            total += sum(c.nbytes for c in rows.caches())
        return total

    # -- the loop ---------------------------------------------------------

    def next(self):
        """``(prompt_responses, generation_responses)``, as mlx-lm's."""
        with mx.stream(self._stream):
            return self._next()

    def next_generated(self):
        with mx.stream(self._stream):
            while True:
                prompt_responses, generation_responses = self._next()
                if not generation_responses and prompt_responses:
                    continue
                return generation_responses

    def _next(self):
        start, measuring, phases = time.perf_counter(), self._measuring, []
        generation_responses = []
        self.round_split = None
        if len(self._generation):
            tic = time.perf_counter()
            batch = len(self._generation)
            generation_responses = self._step()
            phases.append((self.round_kind, f"a round of {batch} sequences", time.perf_counter() - tic))
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1
        self._join()
        # Finished rows riding along take no place: prompts joining make them leave.
        live = sum(not s.finished for s in self._generation.sequences)
        busy = live + len(self._joining)
        if busy >= self.completion_batch_size:
            return [], generation_responses

        room = min(
            self.prefill_batch_size - len(self._prefill),
            self.completion_batch_size - busy - len(self._prefill),
        )
        if room > 0 and self._pending:
            joining = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            self._prefill.extend(self._rows_for(joining))

        prompt_responses = []
        ready = [
            i for i, s in enumerate(self._prefill.sequences)
            if len(s.segments) == 1 and len(s.segments[0]) == 1
        ]
        if self._in_flight is not None and (ready or len(self._prefill)):
            self._in_flight.waited_for = True  # the prompts' evaluation waits for it
        if ready:
            tic = time.perf_counter()
            started = self._prefill.split(ready)
            for s in started.sequences:
                prompt_responses.append(
                    PromptProcessingBatch.Response(s.uid, (s.total, s.total), True, True)
                )
            generation_responses += self._first_step(started)
            self._joining.extend(started)
            self._join()
            seconds = time.perf_counter() - tic
            phases.append(("first steps", f"the first step of {len(ready)}", seconds))
        if len(self._prefill):
            tic = time.perf_counter()
            prompt_responses += self._prefill_chunk()
            seconds = time.perf_counter() - tic
            phases.append(("prefill", f"a prefill chunk of {len(self._prefill)}", seconds))
        if self._measuring > measuring:
            seconds = self._measuring - measuring
            phases.append(("measuring costs", "of which measuring costs", seconds))
        self.phases = phases
        elapsed = time.perf_counter() - start
        if elapsed > SLOW_CALL_SECONDS:
            logging.debug(
                "Slow batch step: %.2f s (%s)", elapsed,
                ", ".join(f"{what} {seconds:.2f} s" for _, what, seconds in phases),
            )
        return prompt_responses, generation_responses

    def _join(self):
        """Prefilled sequences join the batch between rounds, when no round
        is in flight; the finished rows leave as they join (the caches are
        copied anyway)."""
        if self._in_flight is None and len(self._joining):
            self._commit_parked()
            self._drop_finished_rows()
            for s in self._joining.sequences:
                s.acceptance = self._recent.newcomer()
            self._generation.extend(self._joining)
            self._joining = Rows()
            self._last_round = None

    def _drop_finished_rows(self) -> None:
        rows = self._generation
        staying = [b for b, s in enumerate(rows.sequences) if not s.finished]
        if len(staying) < len(rows):
            self._rent = 0.0
        rows.keep(staying)

    def _finished_rows_leave(self) -> bool:
        """Whether the finished rows leave the batch after this round: when
        none is left generating, or once their rent reaches the price of
        taking rows out (at once while that price is not known yet; see the
        module docstring)."""
        finished = sum(s.finished for s in self._generation.sequences)
        if not finished:
            return False
        if finished == len(self._generation) or not self._copies:
            return True
        return self._rent >= statistics.median(self._copies)

    def _account(self, launched: "Launched", seconds: float) -> None:
        """Ski rental's books after a round is read in ``seconds``: the
        finished rows that rode along in it owe their share of it; a round
        after the caches were copied (rows left, or were packed) prices
        taking rows out, as its excess over the last round of its own since
        rows last joined (rows joining add work of their own)."""
        self._rent += seconds * launched.idle / len(launched.sequences)
        if self.round_kind == TIMED:
            self._last_round = seconds
        elif self.round_kind == RESHAPED and self._last_round is not None:
            self._copies.append(max(0.0, seconds - self._last_round))

    def _rows_for(self, sequences: List[Sequence]) -> Rows:
        """Batch caches for sequences joining, from their prompt caches."""
        singles = []
        for s in sequences:
            cache = s.cache
            if cache is None:
                cache = self.target.make_cache(self._max_rollback) + self.drafter.make_cache()
            singles.append(cache)
            s.cache = None
        split = len(singles[0]) - self._num_draft_caches
        target = [
            BatchRollbackKVCache.merge([c[i] for c in singles], w, self._max_rollback)
            for i, w in enumerate(self._windows)
        ]
        batch_cache = getattr(self.drafter, "batch_cache", BatchRollbackKVCache)
        draft = [
            batch_cache.merge([c[split + i] for c in singles], None, self._max_rollback)
            for i in range(self._num_draft_caches)
        ]
        return Rows(sequences, target, draft)

    def _forward(self, rows: Rows, inputs: mx.array):
        return self.target(inputs, rows.target_cache, self.drafter.taps)

    def _propose(self, rows: Rows, anchors: mx.array, k: int, draw=None):
        return self.drafter.propose_batch(
            rows.draft_cache, anchors, k, draw, self.target, rows.target_cache
        )

    def _prefill_chunk(self):
        """One chunk of every prefilling sequence's current segment."""
        rows, responses, chunks = self._prefill, [], []
        for s in rows.sequences:
            chunk = s.segments[0][: self.prefill_step_size]
            s.segments[0] = s.segments[0][len(chunk):]
            end_of_segment = not s.segments[0]
            if end_of_segment:
                s.segments.pop(0)
            s.tokens += chunk
            s.done += len(chunk)
            chunks.append(chunk)
            responses.append(
                PromptProcessingBatch.Response(s.uid, (s.done, s.total), end_of_segment, False)
            )
        width = max(len(c) for c in chunks)
        inputs = mx.array([c + [0] * (width - len(c)) for c in chunks], mx.uint32)
        tic = time.perf_counter()
        out = self._forward(rows, inputs)
        self.drafter.commit(rows.draft_cache, out.hidden)
        rows.trim_rows([width - len(c) for c in chunks])
        rows.compact(self.compact_waste)
        mx.eval([c.state for c in rows.caches()])
        self._counters.prompt_time += time.perf_counter() - tic
        self._counters.prompt_tokens += sum(len(c) for c in chunks)
        return responses

    def _first_step(self, rows: Rows):
        """The target's token after each prompt's last token."""
        last = [s.segments[0][0] for s in rows.sequences]
        out = self._forward(rows, mx.array(last, mx.uint32)[:, None])
        self.drafter.commit(rows.draft_cache, out.hidden)
        responses, firsts = [], []
        for b, s in enumerate(rows.sequences):
            s.segments = []
            context = mx.array(s.tokens + last[b : b + 1], mx.uint32)
            s.tokens.append(last[b])
            log_probs = s.decoding.log_probs(out.logits[b, -1:], context)
            token = s.decoding.next_token(log_probs)
            firsts.append((token, log_probs[0], log_probs[0, token]))
        mx.eval(firsts)
        finished = []
        for b, (s, (token, log_probs, token_log_prob)) in enumerate(zip(rows.sequences, firsts)):
            s.anchor = token.item()
            s.emitted = 1
            reason = self._finish_reason(s, s.anchor)
            log_probs = (log_probs, token_log_prob.item())
            responses.append(self._response(rows, b, s, s.anchor, log_probs, reason))
            if reason:
                finished.append(b)
        if finished:
            rows.keep([b for b in range(len(rows)) if b not in finished])
        return responses

    def _finish_reason(self, s: Sequence, token: int) -> Optional[str]:
        if s.matcher.advance(token):
            return "stop"
        if s.emitted >= s.max_tokens:
            return "length"
        return None

    def _response(self, rows, b, s, token, log_probs, reason):
        """A generation response; ``log_probs``: the position's ``[V]``
        log-probabilities and, read with the round, the token's own."""
        if reason and s.stats.rounds:
            logging.info("Speculative decoding: %s", s.stats.summary())
        return GenerationBatch.Response(
            uid=s.uid,
            token=token,
            logprobs=self._logprobs(token, *log_probs),
            finish_reason=reason,
            prompt_cache=rows.extract(b) if reason else None,
            all_tokens=list(s.tokens) if reason else None,
        )

    def _logprobs(self, token: int, log_probs: mx.array, token_log_prob: float):
        """What a response carries as its ``logprobs``: mlx-lm's ``[V]``
        array."""
        return log_probs

    def _choose_drafts(self, rows: Rows) -> List[int]:
        """Each row's drafts: the policy's choice for the live rows (the
        finished ones verify none, but count in the batch's size)."""
        live = [s for s in rows.sequences if not s.finished]
        caps = [max(0, min(s.num_draft_tokens, s.remaining - 1)) for s in live]
        rates = [s.acceptance.round_rates(cap) for s, cap in zip(live, caps)]
        depth = max(len(s.tokens) for s in rows.sequences)
        most = max((s.num_draft_tokens for s in live), default=0)
        k = self.policy.choose(rates, caps, depth, batch=len(rows), most=most)
        caps = iter(caps)
        return [0 if s.finished else min(k, next(caps)) for s in rows.sequences]

    def measured_costs(self, batch: int, depth: int) -> RoundCosts:
        """A round's costs for the generating batch (of ``batch`` sequences)
        at ``depth``. They are measured on the live caches when the batch
        size is a power of two (or nothing is known yet) and kept on disk per
        size and depth bucket; other sizes interpolate between the sizes
        measured, so a batch that shrinks request by request does not stop
        to measure at every size. A measurement spreads over rounds, a few
        verifies at the end of each (``_measure_after_round``); meanwhile
        the sizes measured stand in, or, with none, the parts measured so
        far. Only a depth with nothing known at all is measured here, as a
        round is chosen. Near the end of a depth bucket that lacks the size,
        the next bucket's sizes stand in as they would there
        (``_next_buckets``), unless it has other sizes complete."""
        timer, profile = self._profile()
        measured = profile.measured_batches(depth, timer.verify_rows)
        if batch in measured:
            return measured[batch]
        ahead = self._next_buckets(depth)
        under_way = profile.partial_batches(depth)
        if not (measured or ahead or under_way):
            return self._measure(batch, depth)  # a part: the policy verifies no more than it covers
        # Parts of measurements stand in only while nothing is complete;
        # they cover the lengths all of them have measured.
        return interpolate(measured or ahead or under_way, batch)

    def _next_buckets(self, depth: int) -> dict:
        """``{batch: RoundCosts}`` measured in the next depth bucket, where
        ``depth`` is near the end of its own (``NEAR_BUCKET_END``), else
        ``{}``: a batch there soon leaves its bucket, whose measurement it
        would take up after each round and never finish. (On an H100, every
        batch of requests with 512-token prompts drafted nothing in its
        first round: its bucket had the first two lengths measured, from the
        first such batch's first round, and no more.)"""
        if depth_bucket(depth + NEAR_BUCKET_END) == depth_bucket(depth):
            return {}
        timer, profile = self._profile()
        return profile.measured_batches(depth + NEAR_BUCKET_END, timer.verify_rows)

    def profiled_costs(self, batch: int, depth: int) -> Optional[RoundCosts]:
        """The costs of rounds of ``batch`` sequences at ``depth`` as the
        profile has them measured, or ``None``."""
        timer, profile = self._profile()
        return profile.measured_batches(depth, timer.verify_rows).get(batch)

    def measure_costs(self) -> RoundCosts:
        """The generating batch's round costs at its depth, measured in full
        now unless the profile has them (``mlx_dspark costs`` measures ahead
        what a server's first rounds would). Between rounds only."""
        rows = self._generation
        if self._in_flight is not None or not len(rows):
            raise RuntimeError("Costs are measured on a generating batch, between rounds.")
        timer, profile = self._profile()
        depth = max(len(s.tokens) for s in rows.sequences)
        return profile.costs(depth, timer, len(rows))

    def _profile(self):
        if self._cost_profile is None:
            timer = RoundTimer(
                self.model,
                self.drafter,
                self.num_draft_tokens,
                self._time_verify,
                self._time_draft,
                batch=0,  # one profile for every batch size, keyed by size
            )
            self._cost_profile = (timer, CostProfile(profile_path(timer.key)))
        return self._cost_profile

    def _measure(self, batch: int, depth: int) -> RoundCosts:
        """The next few verify lengths of ``batch``'s costs at ``depth``,
        timed now; what is measured so far."""
        timer, profile = self._profile()
        tic = time.perf_counter()
        costs = profile.costs(depth, timer, batch, most=VERIFIES_MEASURED_PER_ROUND)
        self._measuring += time.perf_counter() - tic
        self._measured = True
        return costs

    def _measure_after_round(self) -> None:
        """Go on with the generating batch's cost measurement, if the policy
        uses one and it is incomplete (a power of two not measured yet, one
        under way, or any size while none is complete): right after a round
        is read, before its tokens are handed out. Then a server's threads
        that stream the tokens are idle, and do not compete with the timing
        for the host (timed as a round was chosen, right after the server
        had handed out the round before, a 1-row verify at 12B measured 2-3x
        its cost)."""
        rows = self._generation
        if not len(rows) or getattr(self.policy, "costs", None) != self.measured_costs:
            return
        batch, depth = len(rows), max(len(s.tokens) for s in rows.sequences)
        timer, profile = self._profile()
        measured = profile.measured_batches(depth, timer.verify_rows)
        under_way = profile.partial_batches(depth)
        # While no size is complete, the parts under way cap the drafts: a
        # batch that left the size being measured measures its own.
        starts = batch & (batch - 1) == 0 or not measured
        if batch not in measured and self._next_buckets(depth):
            return
        if batch in under_way or (batch not in measured and starts):
            self._measure(batch, depth)
            if self._in_flight is not None:
                self._in_flight.waited_for = True  # the timing waited for it

    def _anchors(self) -> mx.array:
        return mx.array([s.anchor for s in self._generation.sequences], mx.uint32)

    def _time_verify(self, n: int):
        rows = self._generation
        out = self._forward(rows, mx.repeat(self._anchors()[:, None], n, axis=1))
        for c in rows.target_cache:
            c.trim(n)
        return out.logits, out.hidden

    def _time_draft(self, drafts: int):
        self._commit_parked()
        proposal = self._propose(self._generation, self._anchors(), drafts)
        return proposal.tokens, proposal.confidence

    def _step(self):
        """Read one round; before that, launch the next one when nothing
        has to wait for the host (see ``_can_overlap``). The policy learns
        how long the round took (measuring costs aside), unless that time is
        not its own (``_round_kind``).

        A round launched ahead ran on the device from the last round's read
        on, also while the server was away between calls: it is timed from
        that read. Where the server was away longer than it then waited, the
        round may have been done before it came back; its time is unknown
        (timed from this call, it would look almost free)."""
        tic, measuring = time.perf_counter(), self._measuring
        launched_ahead = self._in_flight is not None
        if not launched_ahead:
            self._in_flight = self._launch(self._anchors())
        ahead = None
        if self._can_overlap():
            ahead = self._launch(self._in_flight.anchors)
        built, measured = time.perf_counter(), self._measuring - measuring
        responses = self._collect(self._in_flight, reuse=ahead is None)
        read = time.perf_counter()
        self.round_split = (built - tic - measured, self._waited, read - built - self._waited)
        # Handing finished rows' caches back is no round's cost either.
        self.round_kind = _round_kind(self._in_flight, any(r.finish_reason for r in responses))
        if self.round_kind == TIMED and ahead is not None:
            self.round_kind = _round_kind(ahead, False)
        elapsed = read - tic - (self._measuring - measuring)
        if launched_ahead and self.round_kind == TIMED:
            # (Costs measured since the last read made this round one waited for.)
            away = tic - self._last_read
            if away > elapsed:
                self.round_kind = AWAY
            else:
                elapsed += away
        self._last_read = read
        observe = getattr(self.policy, "observe", None)
        if observe is not None:
            observe(elapsed if self.round_kind == TIMED else None)
        self._account(self._in_flight, elapsed)
        self._in_flight = ahead
        if ahead is None:
            rows = self._generation
            if rows.wasteful(self.compact_waste) or self._finished_rows_leave():
                # The drafter takes the parked rounds in now, so that the round
                # after the copy pays for the copy alone (``_account``).
                self._commit_parked()
                mx.eval([c.state for c in rows.draft_cache])
                # Packing copies caches anyway.
                self._drop_finished_rows()
                rows.compact(self.compact_waste)
        self._measure_after_round()
        return responses

    def _can_overlap(self) -> bool:
        """Whether the next round can be built before this one is read:
        the batch stays as it is (no finished rows leaving, none joining), no
        sequence's logits processors need its tokens on the host, no
        sequence is so near its budget that what this round emits limits
        the next one's drafts, and no cache needs packing (which needs the
        host's lengths). (A round whose drafts the policy reads before
        the verify, see ``_truncating``, waits for the round before it
        while it is built.)"""
        rows = self._generation
        return (
            self.pipeline
            and not len(self._joining)
            and not self._finished_rows_leave()
            and all(
                s.finished or (
                    not s.decoding.processors and s.remaining > s.num_draft_tokens
                )
                for s in rows.sequences
            )
            and not rows.wasteful(self.compact_waste)
        )

    def _launch(self, anchors: mx.array) -> "Launched":
        """Build one draft-and-verify round for every generating sequence
        from the anchors (on the device) and start it; each row's rollback
        and next anchor are computed on the device too."""
        rows = self._generation
        sequences = list(rows.sequences)
        drafts_per_row = self._choose_drafts(rows)
        k = self._width(rows, max(drafts_per_row))
        after_measuring, self._measured = self._measured, False
        contexts = [None if s.finished else s.context() for s in sequences]
        proposal, took_in_parked, read = None, False, None
        reshaped, rows.reshaped = rows.reshaped, False
        if k:
            took_in_parked = bool(self._parked_taps)
            self._commit_parked()
            draws = [
                None if s.finished else s.decoding.draw_for(c)
                for s, c in zip(sequences, contexts)
            ]
            draw = None if all(d is None for d in draws) else _batch_draw(draws)
            proposal = self._propose(rows, anchors, k, draw)
            if self._truncating() and proposal.confidence is not None:
                drafts_per_row, read = self._truncate(rows, proposal, drafts_per_row)
                k = self._width(rows, max(drafts_per_row), most=k)
                # Verifying none of them is a round without drafts; the
                # drafter's caches are as they were before it drafted.
                proposal = proposal.first(k) if k else None
        if k:
            # Let the device draft while the host builds the verify.
            mx.async_eval(proposal.tokens)
            inputs = mx.concatenate([anchors[:, None], proposal.tokens], axis=1)
        else:
            inputs = anchors[:, None]
        out = self._forward(rows, inputs)
        log_probs, accepted, tokens = self._judge(
            sequences, proposal, out.logits, drafts_per_row, contexts
        )
        if k:
            # Each row keeps its anchor and accepted drafts; the drafter
            # takes in the taps of what it kept.
            rejected = k - accepted
            for c in rows.target_cache:
                c.rollback(rejected)
            self.drafter.commit(rows.draft_cache, out.hidden, proposal)
            for c in rows.draft_cache:
                c.rollback(rejected)
        else:
            # Every row keeps its one token; the drafter takes the taps in
            # when it is next needed, all rounds in one call.
            self._parked_taps.append(out.hidden)
            if len(self._parked_taps) >= MAX_PARKED_ROUNDS:
                took_in_parked = True
                self._commit_parked()
        launched = Launched(
            sequences, drafts_per_row, proposal, log_probs, accepted, tokens,
            token_log_probs=_log_probs_of(log_probs, tokens),
            anchors=mx.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0],
            took_in_parked=took_in_parked,
            confidences=read,
            reshaped=reshaped,
            after_measuring=after_measuring,
            idle=sum(s.finished for s in sequences),
        )
        for s, n in zip(sequences, drafts_per_row):
            s.in_flight += n + 1
        mx.async_eval(launched.outputs(), launched.anchors, [c.state for c in rows.caches()])
        return launched

    def _width(self, rows: Rows, drafts: int, most: Optional[int] = None) -> int:
        """How many drafts a round drafts and verifies for each sequence
        when ``drafts`` at most are judged: the policy's ``width``, up to
        ``most`` (by default the most any generating sequence may verify,
        not the drafter's most, which may be far more drafter steps), else
        ``drafts``. Rows judge their own drafts only; the rest is padding."""
        width = getattr(self.policy, "width", None)
        if not drafts or width is None:
            return drafts
        if most is None:
            most = max(s.num_draft_tokens for s in rows.sequences if not s.finished)
        depth = max(len(s.tokens) for s in rows.sequences)
        return width(drafts, most, depth, batch=len(rows))

    def _truncating(self) -> bool:
        """Whether the policy picks each round's drafts from their calibrated
        confidences (``BatchPolicy.truncate``): the host then reads them
        before it builds the verify."""
        return (
            getattr(self.policy, "truncate", None) is not None
            and getattr(self.drafter, "calibration", None) is not None
        )

    def _truncate(self, rows: Rows, proposal, drafts_per_row: List[int]):
        """Each row's drafts to verify, once the host has read the drafts'
        confidences, and the confidences of the drafts each row could
        verify (its own budget and draft count allowing)."""
        temperatures = self.drafter.calibration.temperatures
        confidence = proposal.confidence.tolist()
        live = [b for b, s in enumerate(rows.sequences) if not s.finished]
        survivals = [survival(confidence[b][: drafts_per_row[b]], temperatures) for b in live]
        depth = max(len(s.tokens) for s in rows.sequences)
        caps = [drafts_per_row[b] for b in live]
        k = self.policy.truncate(survivals, caps, depth, batch=len(rows), drawn=max(drafts_per_row))
        confidence = [row[:n] for row, n in zip(confidence, drafts_per_row)]
        return [min(k, n) for n in drafts_per_row], confidence

    def _collect(self, launched: "Launched", reuse: bool):
        """The responses of a launched round, once the device has it: each
        sequence emits its accepted drafts and the target's next token, up
        to a stop or its budget."""
        tic = time.perf_counter()
        mx.eval(launched.outputs())
        self._waited = time.perf_counter() - tic
        k = launched.k
        accepted = launched.accepted.tolist()
        tokens = launched.tokens.tolist()
        token_log_probs = launched.token_log_probs.tolist()
        proposal = launched.proposal
        drafted = proposal.tokens.tolist() if k else [[] for _ in accepted]
        confidence = (
            proposal.confidence.tolist()
            if k and proposal.confidence is not None
            else [None] * len(accepted)
        )
        rows, responses = self._generation, []
        for b, s in enumerate(launched.sequences):
            s.in_flight -= launched.drafts_per_row[b] + 1
            if s.finished:
                continue
            n = launched.drafts_per_row[b]
            emitted, reason = [], None
            for t in tokens[b][: accepted[b] + 1]:
                emitted.append(t)
                s.emitted += 1
                reason = self._finish_reason(s, t)
                if reason:
                    break
            kept = min(accepted[b], len(emitted))
            next_token = emitted[-1] if len(emitted) > accepted[b] else None
            verified = n if next_token is not None else kept
            self._record(s, n, kept, verified, next_token, drafted[b], confidence[b])
            if launched.confidences is not None and next_token is not None and kept == n:
                self._expect(s, n, launched.confidences[b])
            # Cached now: the anchor and every emitted token but the last.
            s.tokens += [s.anchor] + emitted[:-1]
            s.anchor = emitted[-1]
            s.finished = reason is not None
            if s.finished:
                self._commit_parked()  # its caches are handed back
            for i, t in enumerate(emitted):
                last = i == len(emitted) - 1
                log_probs = (launched.log_probs[b][i], token_log_probs[b][i])
                responses.append(self._response(rows, b, s, t, log_probs, reason if last else None))
        rows.settle([k - a for a in accepted], reuse)
        return responses

    def _commit_parked(self):
        """The drafter takes in the taps of the rounds without drafts since
        it last drafted, in one call (a parked batch pays no drafter work
        per round). Needed before it drafts and before the batch's rows or
        caches change or leave."""
        if self._parked_taps:
            taps = [mx.concatenate(t, axis=1) for t in zip(*self._parked_taps)]
            self._parked_taps = []
            self.drafter.commit(self._generation.draft_cache, taps)

    def _judge(self, sequences, proposal, logits, drafts_per_row, contexts):
        """Each row's processed log-probabilities, its accepted count and
        ``k + 1`` tokens to emit a prefix of, all on the device: the
        plain-greedy rows in one batched verdict, the others each under its
        own rule. Row ``b`` judges ``drafts_per_row[b]`` of the round's
        ``k`` drafts."""
        k = logits.shape[1] - 1
        drafts = proposal.tokens if k else mx.zeros((len(sequences), 0), mx.uint32)
        counts = mx.array(drafts_per_row)
        # A finished row's verdict is never read: judged greedily, it draws
        # nothing and runs no processors.
        greedy = [b for b, s in enumerate(sequences) if s.finished or s.decoding.plain_greedy]
        if len(greedy) == len(sequences):
            log_probs, accepted, tokens = judge_greedy(drafts, logits, counts)
            return log_probs, accepted, tokens
        log_probs, accepted, tokens = [None] * len(sequences), [], []
        if greedy:
            index = mx.array(greedy)
            group = judge_greedy(drafts[index], logits[index], counts[index])
        for b, s in enumerate(sequences):
            if b in greedy:
                i = greedy.index(b)
                log_probs[b], a, t = (x[i] for x in group)
            else:
                n = drafts_per_row[b]
                draft_log_probs = proposal.log_probs[b] if k and proposal.log_probs is not None else None
                log_probs[b], a, t = s.decoding.judge(
                    drafts[b, :n], draft_log_probs, logits[b, : n + 1], contexts[b],
                    s.num_draft_tokens + 1,
                )
                t = mx.pad(t.astype(mx.uint32), (0, k - n))
            accepted.append(a)
            tokens.append(t)
        return log_probs, mx.stack(accepted).astype(mx.int32), mx.stack(tokens)

    def _expect(self, s, first: int, confidence: List[float]) -> None:
        """A row's drafts from ``first`` on, which it could have verified and
        the truncation refused after every verified one was accepted, count
        at their calibrated confidences (``Acceptance.expect``)."""
        if first < len(confidence):
            rates = kept_rates(confidence, self.drafter.calibration.temperatures)[first:]
            s.acceptance.expect(first, rates)
            self._recent.expect(first, rates)

    def _record(self, s, proposed, accepted, verified, next_token, drafts, confidence):
        s.acceptance.update(proposed, accepted)
        self._recent.update(proposed, accepted)
        temperatures = getattr(getattr(self.drafter, "calibration", None), "temperatures", None)
        predicted = None
        if confidence is not None:
            predicted = sum(survival(confidence[:verified], temperatures))
        s.stats.history.append(
            Round(
                start=len(s.tokens),
                anchor=s.anchor,
                drafts=drafts[:proposed],
                confidence=confidence,
                proposed=verified,
                accepted=accepted,
                next_token=next_token,
                predicted=predicted,
            )
        )


@dataclass
class Launched:
    """A round built and started on the device, not yet read by the host."""

    sequences: List[Sequence]
    drafts_per_row: List[int]
    proposal: Any  # the drafter's Proposal, None in a round without drafts
    log_probs: Any  # row b's processed log-probabilities at [b], [n_b + 1 or k + 1, V]
    accepted: mx.array  # [B]
    tokens: mx.array  # [B, k + 1]
    token_log_probs: mx.array  # [B, k + 1]: each of ``tokens``' log-probability
    anchors: mx.array  # [B]: the next round's anchors
    took_in_parked: bool = False  # the drafter took in parked rounds' taps too
    # Each row's confidences of the drafts it could verify, where the host read
    # them to choose the drafts to verify (more than ``proposal`` keeps).
    confidences: Optional[list] = None
    reshaped: bool = False  # it also copied caches for rows joined or left
    # Launched after costs were timed, whose verifies of other lengths make
    # the next round's shape a change (see ``policy.PROBE_ROUNDS``).
    after_measuring: bool = False
    idle: int = 0  # finished rows riding along
    waited_for: bool = False  # the host waited for it before reading it

    @property
    def k(self) -> int:
        """Drafts drafted and verified per row (a row judges its own
        ``drafts_per_row``, the rest is padding)."""
        return self.tokens.shape[1] - 1

    def outputs(self) -> list:
        """What the host reads: the verdict, and the drafts and confidences
        for the statistics."""
        proposal = [self.proposal.tokens, self.proposal.confidence] if self.k else []
        verdict = [self.accepted, self.tokens, self.token_log_probs]
        return verdict + [x for x in proposal if x is not None]


def _round_kind(launched: Launched, handed_back: bool) -> str:
    """A round's kind for the policy and the load log: ``TIMED`` when its
    read time is its own, else the first thing it also paid for."""
    if handed_back:
        return "rounds handing caches back"
    if launched.reshaped:
        return RESHAPED
    if launched.took_in_parked:
        return "rounds taking in parked rounds"
    if launched.waited_for:
        return "rounds already waited for"  # by prompts evaluated, or costs timed, behind them
    if launched.after_measuring:
        return "rounds after costs were measured"
    return TIMED


def _log_probs_of(log_probs, tokens: mx.array) -> mx.array:
    """``[B, k + 1]``: row ``b``'s log-probability of each of its ``tokens``
    (``log_probs``: ``[B, k + 1, V]``, or row ``b``'s ``[n_b + 1, V]`` or
    ``[k + 1, V]`` at ``[b]``, zeros past its own)."""
    indices = tokens[..., None].astype(mx.int32)
    if isinstance(log_probs, mx.array):
        return mx.take_along_axis(log_probs, indices, axis=-1)[..., 0]
    width = tokens.shape[1]
    return mx.stack([
        mx.pad(mx.take_along_axis(lp, indices[b, : lp.shape[0]], axis=-1)[:, 0], (0, width - lp.shape[0]))
        for b, lp in enumerate(log_probs)
    ])


def _batch_draw(draws):
    """One ``draw`` for a batch from each row's (``None``: argmax)."""

    def draw(logits):
        tokens, log_qs = [], []
        for b, row_draw in enumerate(draws):
            row = logits[b : b + 1]
            if row_draw is None:
                token, log_q = mx.argmax(row, axis=-1), None
            else:
                token, log_q = row_draw(row)
            tokens.append(token.reshape(1).astype(mx.uint32))
            log_qs.append(log_q)
        if all(q is None for q in log_qs):
            return mx.concatenate(tokens), None
        log_qs = [mx.zeros_like(logits[:1]) if q is None else q for q in log_qs]
        return mx.concatenate(tokens), mx.concatenate(log_qs)

    return draw
