"""What a round costs on this machine: one draft, and a verify of 1..n tokens,
at the current context depth.

Measuring takes a few dozen forwards, so profiles are kept on disk, one file
per target (architecture, shapes, quantization, dtype), drafter, MLX version
and device, one entry per context-depth bucket, re-measured when older than
``MAX_AGE`` or when a longer verify is needed.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..targets import multirow
from .calibration import user_cache_dir

MAX_AGE = 7 * 24 * 3600.0
# Seconds a profile's writer waits for another's lock (see ``_locked``).
LOCK_WAIT = 5.0
REPEATS = 3
# How a cost is read from its repeats. Whatever else the machine does only
# adds time: in a server, the handler threads that stream the tokens of the
# round just read compete with the measurement for the host (on an H200 the
# first verify measured in a round took 2-4x the others). And it comes in
# bursts: repeats of one verify length in a row all fell into one (an H200's
# 12B verifies of 6 and 7 tokens measured 27-28 ms between 17-18 ms ones),
# so the repeats are passes over every part measured, and a measurement
# spread over rounds (``CostProfile.costs``' ``most``) makes one pass over
# every part before the next (measured a few parts a round, all repeats at
# once, an H200's 12B verifies of 4 and 5 tokens came out at 23 ms among
# 18-20 ms ones, and a single stream padded its verifies around them).
# Part of the key of a profile, so that profiles measured another way are
# measured again.
TIMING = (
    "fastest of the repeats, in passes over the parts, also across rounds; "
    "a draft of one and of all"
)
# MLX's settings of how kernels are launched, which change what a round
# costs (on an H200, a bf16 verify took 31.7 ms with CUDA graphs and 20.8 ms
# without): part of a profile's key where set.
LAUNCH_SETTINGS = (
    "MLX_USE_CUDA_GRAPHS", "MLX_CUDA_GRAPH_CACHE_SIZE", "MLX_MAX_OPS_PER_BUFFER",
    "MLX_MAX_MB_PER_BUFFER",
)

# MLX-CUDA's CUDA graphs against speculative rounds of an unquantized target
# (H200, 12B shapes, bf16, BENCHMARKS.md "Session 18" and "Session 19"): the
# batched server at 1.42-2.95x of stock without them against 1.31-2.01x with
# them, a single stream at 2.18x against 1.75x. A 4-bit target's runs went
# both ways, so it keeps them.
NO_CUDA_GRAPHS = {"MLX_USE_CUDA_GRAPHS": "0"}

# A verify pads to more rows only where they cost at least this much less,
# and so do the rows one past them. Where a device switches kernels by row
# count (4-bit 12B on an H200: 7 rows 56 ms, 8 rows 29 ms, 9 and more
# 29-30 ms) the rows past the switch are all cheaper; one row count alone
# is the measurement's noise: on a loaded CPU a 5-row verify measured 28%
# under a 1-row one and 6 rows 35% over it, and a generation that profile
# paced verified five rows in 108 of its 120 rounds, parked ones included.
PAD_SAVING = 0.10

# Cost policies measure a new depth bucket's (or batch size's) costs on the
# live caches this many verify lengths a round, so that no round stops a
# generation for long (a whole measurement took 5-17 s at 12B on CUDA).
VERIFIES_MEASURED_PER_ROUND = 2

# A single stream's depth this close to the end of its bucket, whose bucket
# is not measured yet, takes the next bucket's costs where those are: the
# generation soon leaves the bucket, and each one passing through would
# otherwise stall a round measuring it, for costs it barely uses: on an H200
# each 4-bit 12B generation from a 2048-token prompt spent its first round,
# the only one at depth 2048, measuring two more verify lengths of that
# bucket (170-250 ms, 15% of a 128-token generation parked in every round).
# A batch generator's entries are left alone here: it reads which batch sizes
# are measured bucket by bucket (``measured_batches``), and near a bucket's
# end takes the next bucket's sizes itself where its own has none complete
# (``SpeculativeBatchGenerator._next_buckets``).
NEAR_BUCKET_END = 64


@dataclass(frozen=True)
class RoundCosts:
    """Seconds for a proposal of ``drafts`` drafts (``draft``) and of one
    (``draft_one``, where measured), and for verifying ``n`` tokens
    (``verify[n - 1]``)."""

    draft: float
    verify: List[float]
    draft_one: Optional[float] = None
    drafts: int = 1

    def drafting(self, drafts: int) -> float:
        """Seconds for a proposal of ``drafts`` drafts: on the line through
        one's and ``self.drafts``' (never below the cheaper of the two). A
        drafter that drafts one at a time (the Gemma-4 assistant, a step of
        its own a draft) costs less for fewer; a block drafter (DSpark,
        DFlash) costs the same for any number."""
        if drafts <= 0:
            return 0.0
        if self.draft_one is None or self.drafts <= 1:
            return self.draft
        share = (drafts - 1) / (self.drafts - 1)
        seconds = self.draft_one + (self.draft - self.draft_one) * share
        return max(seconds, min(self.draft, self.draft_one))

    def rounds_per_second(self, tokens: int) -> float:
        """Rounds per second when a round verifies ``tokens`` tokens."""
        return 1.0 / (self.draft + self.verify[tokens - 1])

    def cheapest_rows(self, tokens: int) -> int:
        """The row count a verify of ``tokens`` tokens runs at: where the
        device switches kernels by row count, more rows can cost less. The
        cheapest (the fewest among equals) of the row counts that, like the
        row count after them, cost ``PAD_SAVING`` less than ``tokens`` rows;
        else ``tokens`` (so never the last row count measured)."""
        if tokens > len(self.verify):
            return tokens
        saving = self.verify[tokens - 1] * (1 - PAD_SAVING)
        rows = [
            n for n in range(tokens + 1, len(self.verify))
            if self.verify[n - 1] <= saving and self.verify[n] <= saving
        ]
        return min(rows, key=lambda n: (self.verify[n - 1], n), default=tokens)

    def padded(self) -> "RoundCosts":
        """These costs when every verify runs at its ``cheapest_rows``."""
        return self._padded

    # Worked out once: a single stream's every round, parked ones too, pads
    # the costs of its depth (a sixth of a parked round's pacing, otherwise).
    @cached_property
    def _padded(self) -> "RoundCosts":
        return dataclasses.replace(
            self,
            verify=[self.verify[self.cheapest_rows(n) - 1] for n in range(1, len(self.verify) + 1)],
        )


def verify_rows(drafts: int) -> int:
    """Rows a cost-aware round may verify with ``drafts`` drafts (padding
    included), so the verify costs measured reach past the kernel switches
    seen at 8 rows (docs/confidence-scheduling.md)."""
    return max(drafts + 1, 16)


def depth_bucket(depth: int) -> int:
    """Context depths that share a measurement: powers of two from 512."""
    return max(512, 1 << max(depth - 1, 0).bit_length())


def model_fingerprint(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    quantized = {
        (m.bits, m.group_size, getattr(m, "mode", "affine"))
        for _, m in model.named_modules()
        if hasattr(m, "bits") and hasattr(m, "group_size")
    }
    dtypes = {p.dtype for _, p in tree_flatten(model.parameters())}
    return {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {},
        "quantization": sorted(quantized),
        "dtypes": sorted(str(d) for d in dtypes),
    }


def launch_settings_for_speculation(model: nn.Module) -> dict:
    """Sets the launch settings for a process that decodes ``model`` with a
    drafter, and says so on stderr: ``NO_CUDA_GRAPHS`` on MLX-CUDA for an
    unquantized target, unless the user set ``MLX_USE_CUDA_GRAPHS``. Returns
    what it set (``{}``: nothing). MLX reads it once, at its first evaluation
    on the device: call this before."""
    if any(name in os.environ for name in NO_CUDA_GRAPHS):
        return {}
    if model_fingerprint(model)["quantization"] or not mx.cuda.is_available():
        return {}
    os.environ.update(NO_CUDA_GRAPHS)
    made = " ".join(f"{name}={value}" for name, value in NO_CUDA_GRAPHS.items())
    print(
        f"mlx-dspark: {made} for speculative decoding of an unquantized target on "
        "MLX-CUDA (faster rounds); set MLX_USE_CUDA_GRAPHS=1 to keep CUDA graphs.",
        file=sys.stderr,
    )
    return dict(NO_CUDA_GRAPHS)


def device_identity() -> dict:
    """What identifies this machine's device in ``mx.device_info()``: its
    static fields only (on CUDA it also reports free memory, which would
    give every process a profile of its own)."""
    info = mx.device_info()
    return {k: info[k] for k in ("architecture", "device_name", "memory_size") if k in info}


def drafter_identity(drafter) -> dict:
    """What a drafter's costs depend on: its checkpoint (``fingerprint``,
    else its ``repr``, else its class: never an object's address, which
    would give every process a profile of its own) and its network's
    shapes, precision and quantization."""
    name = getattr(drafter, "fingerprint", None)
    if name is None:
        kind = type(drafter)
        name = repr(drafter) if kind.__repr__ is not object.__repr__ else (
            f"{kind.__module__}.{kind.__qualname__}"
        )
    network = getattr(drafter, "model", None)
    return {
        "checkpoint": name,
        "network": model_fingerprint(network) if isinstance(network, nn.Module) else None,
    }


@dataclass
class RoundTimer:
    """Times a round's parts on live caches, for rounds of ``drafts`` drafts.

    ``verify(n)`` runs the target on ``n`` tokens and rolls them back, which
    leaves the caches as a round whose drafts were all rejected leaves them;
    ``draft(n)`` makes one proposal of ``n`` drafts, which leaves the
    drafter's caches as they were. Both return what to evaluate."""

    model: nn.Module
    drafter: Any
    drafts: int
    verify: Callable[[int], Any]
    draft: Callable[[], Any]
    batch: int = 1  # sequences per round (``verify(n)`` runs batch x n rows)
    rows: Optional[int] = None  # verifies measured: 1..rows (default drafts + 1)

    @property
    def verify_rows(self) -> int:
        return self.rows or self.drafts + 1

    @cached_property
    def key(self) -> str:
        identity = {
            "target": model_fingerprint(self.model),
            "drafter": drafter_identity(self.drafter),
            "drafts": self.drafts,
            "batch": self.batch,
            **({"rows": self.rows} if self.rows else {}),
            "timing": TIMING,
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "device_info": device_identity(),
        }
        settings = {name: os.environ[name] for name in LAUNCH_SETTINGS if name in os.environ}
        if settings:
            identity["settings"] = settings
        routed = multirow.routing(self.model)
        if routed:  # its verifies are not MLX's kernels'
            identity["multirow"] = routed
        text = json.dumps(identity, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def __call__(
        self, tokens: Optional[Iterable[int]] = None, draft: bool = True,
        tick: Optional[Callable[[], Any]] = None, repeats: int = REPEATS,
    ) -> RoundCosts:
        """Costs of a proposal of ``drafts`` drafts and of one (unless not
        ``draft``: 0) and of verifying each of ``tokens`` tokens (by default
        ``1, 2, ...`` up to ``verify_rows``), the fastest of ``repeats``;
        ``tick()`` after each part timed (a progress bar's)."""
        tokens = range(1, self.verify_rows + 1) if tokens is None else tokens
        drafts = []
        if draft:
            drafts = [partial(self.draft, self.drafts), partial(self.draft, 1)][: min(self.drafts, 2)]
        parts = [partial(self.verify, n) for n in tokens]
        seconds = fastest_seconds(*drafts, *parts, tick=tick, repeats=repeats)
        drafted = seconds[: len(drafts)]
        return RoundCosts(
            draft=drafted[0] if drafted else 0.0,
            verify=seconds[len(drafts):],
            draft_one=drafted[-1] if drafted else None,
            drafts=self.drafts,
        )


def fastest_seconds(
    *fns: Callable[[], Any],
    clock: Optional[Callable[[], float]] = None,
    tick: Optional[Callable[[], Any]] = None,
    repeats: int = REPEATS,
) -> List[float]:
    """The fewest seconds each of ``fns()`` took with its result evaluated,
    of ``repeats`` passes over all of them (see ``TIMING``). Within a pass
    each runs once untimed before it is timed: the first use of a shape
    compiles, and on MLX-CUDA any change of shape costs its first round
    40-70 ms (``batching.policy.PROBE_ROUNDS``), where a round of a server
    mostly repeats the shape before it."""
    clock = clock or time.perf_counter
    fastest = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            mx.eval(fn())
            tic = clock()
            mx.eval(fn())
            fastest[i] = min(fastest[i], clock() - tic)
            if tick is not None:
                tick()
    return fastest


def live_timer(
    model, drafter, target, target_cache, draft_cache, drafts, anchor, rows=None,
    catch_up=None,
) -> RoundTimer:
    """A ``RoundTimer`` on one sequence's live caches: verifies (of up to
    ``rows`` tokens) repeat the current ``anchor()`` and are rolled back,
    drafts propose ``drafts`` (and one), after ``catch_up()`` (the drafter takes in
    what it has yet to)."""

    def verify(n):
        tokens = mx.repeat(anchor().reshape(1), n)[None]
        out = target(tokens, target_cache, drafter.taps)
        for c in target_cache:
            c.trim(n)
        return out.logits, out.hidden

    def draft(count):
        if catch_up is not None:
            catch_up()
        proposal = drafter.propose(
            draft_cache, anchor(), count, target=target, target_cache=target_cache
        )
        return proposal.tokens, proposal.confidence

    return RoundTimer(model, drafter, drafts, verify, draft, rows=rows)


class CostProfile:
    """Measured ``RoundCosts`` per depth bucket, for one timer key."""

    def __init__(self, path: Optional[Path], max_age: float = MAX_AGE):
        self.path = path
        self.max_age = max_age
        self.entries = self._read()
        self._partial = {}  # entry key -> the _Partial measurement under way
        # entry key -> (its entry, its RoundCosts): entries are replaced
        # (measured again, merged from the file), never changed in place.
        self._built = {}
        self.timings = 0  # calls that timed parts on the live caches

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
            return entries if isinstance(entries, dict) else {}
        except (AttributeError, OSError, ValueError):
            return {}

    def _write(self) -> None:
        """Writes the entries, with those another process (a server, a
        second worker, ``mlx_dspark costs``) wrote meanwhile: the newer
        measurement of a bucket is kept. Each writer writes a file of its
        own and moves it into place, so that a reader never sees half of
        one, and holds the profile's lock from its read to that move, so
        that two writing at once do not each drop what the other wrote."""
        if self.path is None:
            return
        written = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path):
                for key, entry in self._read().items():
                    if self._rank(entry) > self._rank(self.entries.get(key)):
                        self.entries[key] = entry
                        self._partial.pop(key, None)  # another process's is further on
                with tempfile.NamedTemporaryFile(
                    "w", dir=self.path.parent, prefix=self.path.stem, suffix=".partial",
                    delete=False,
                ) as f:
                    written = f.name
                    json.dump(self.entries, f, indent=1)
                os.replace(written, self.path)
        except BaseException as e:
            if written is not None:
                with contextlib.suppress(OSError):
                    os.unlink(written)
            if not isinstance(e, OSError):
                raise
            # An unwritable cache only costs a re-measurement next time.

    def _rank(self, entry) -> tuple:
        """How an entry of the file ranks against another for its bucket (the
        higher is kept): a fresh whole measurement above one under way, that
        above a stale or malformed one; among equals, the later."""
        if not isinstance(entry, dict):
            return (0, -math.inf)
        when = entry.get("measured_at")
        when = when if isinstance(when, (int, float)) else -math.inf
        if "passes" in entry:
            return (1, when)
        fresh = 0 <= time.time() - when <= self.max_age and isinstance(entry.get("verify"), list)
        return (2 if fresh else 0, when)

    def _fresh(self, key: str, tokens: int) -> Optional[RoundCosts]:
        """The costs of ``key``'s entry where it is well-formed, fresh and
        has a verify cost for ``tokens``, else ``None``. (Each entry is
        checked and built once: a parked round looks its costs up several
        times, a third of its pacing when each look checked them all.)"""
        entry = self.entries.get(key)
        built = self._built.get(key)
        if built is None or built[0] is not entry:
            costs = _costs(entry) if _well_formed(entry) else None
            built = self._built[key] = (entry, costs)
        costs = built[1]
        if costs is None or len(costs.verify) != tokens:
            return None
        if not 0 <= time.time() - entry["measured_at"] <= self.max_age:
            return None
        return costs

    def costs(
        self, depth: int, timer: RoundTimer, batch: Optional[int] = None,
        most: Optional[int] = None,
    ) -> RoundCosts:
        """The costs at ``depth`` (for rounds of ``batch`` sequences, when the
        profile is a batch generator's), measured with ``timer`` when this
        profile has none (or only stale or malformed ones) for that bucket
        (near a bucket's end, a single stream may take the next bucket's,
        ``NEAR_BUCKET_END``).

        With ``most``, a call times at most that many verifies once (and
        the draft with the first of them), one pass over all of them after
        another (``REPEATS``, see ``TIMING``), and returns the fastest of what
        is timed so far, its ``verify`` short of ``timer.verify_rows`` until
        the first pass is over: a server measures across rounds instead of
        stopping every request for the whole measurement."""
        key = self._entry_for(depth, batch, timer.verify_rows)
        costs = self._fresh(key, timer.verify_rows)
        if costs is None:
            self.timings += 1
            if most is None:
                measured = timer()
            else:
                # Kept only once a part is timed (a timing that fails leaves none).
                under_way = self._under_way(key) or _Partial()
                measured = under_way.go_on(timer, most)
                if under_way.passes < REPEATS:
                    # On disk too: a process that ends first (a short
                    # generation of mlx_lm.generate) leaves it to the next.
                    self._partial[key] = under_way
                    self.entries[key] = under_way.entry(depth)
                    self._write()
                    return measured
            self._partial.pop(key, None)
            entry = dict(
                draft=measured.draft,
                draft_one=measured.draft_one,
                drafts=measured.drafts,
                verify=measured.verify,
                depth=depth,
                measured_at=time.time(),
            )
            self.entries[key] = entry
            self._write()
            costs = _costs(entry)
        return costs

    def measured(self, depth: int, timer: RoundTimer) -> Optional[RoundCosts]:
        """A single stream's whole measurement at ``depth``, or ``None``."""
        return self._fresh(self._entry_for(depth, None, timer.verify_rows), timer.verify_rows)

    def known(self, depth: int, timer: RoundTimer) -> Optional[RoundCosts]:
        """What is measured at ``depth`` so far, measuring nothing: the whole
        measurement, the part under way, or ``None``."""
        measured = self.measured(depth, timer)
        if measured is not None:
            return measured
        under_way = self._under_way(self._entry_for(depth, None, timer.verify_rows))
        return under_way and under_way.fastest

    def _entry_for(self, depth: int, batch: Optional[int], tokens: int) -> str:
        """The key of the entry that stands for ``depth``: its bucket's, or
        for a single stream near the bucket's end, where that is not
        measured and the next one is, the next one's (``NEAR_BUCKET_END``)."""
        key = _entry_key(depth, batch)
        if batch is None and self._fresh(key, tokens) is None:
            ahead = _entry_key(depth + NEAR_BUCKET_END, batch)
            if self._fresh(ahead, tokens) is not None:
                return ahead
        return key

    def _under_way(self, key: str) -> Optional["_Partial"]:
        """The measurement under way for ``key`` (this process's, or one
        another left on disk), unless it started longer ago than a
        measurement stays fresh (then it is dropped: a server's batch size
        that left would keep standing in with it)."""
        under_way = self._partial.get(key)
        if under_way is None:
            under_way = _Partial.from_entry(self.entries.get(key))
            if under_way is not None:
                self._partial[key] = under_way
        if under_way is not None and not 0 <= time.time() - under_way.started <= self.max_age:
            del self._partial[key]
            return None
        return under_way

    def measured_batches(self, depth: int, tokens: int) -> dict:
        """``{batch: RoundCosts}`` of the usable batch entries at ``depth``,
        and of the measurements under way there past their first pass over
        every length (the later passes only refine them)."""
        found = {}
        for key in list(self.entries):
            batch, _, bucket = key.partition("x")
            costs = bucket == str(depth_bucket(depth)) and self._fresh(key, tokens)
            if costs:
                found[int(batch)] = costs
        for batch, under_way in self.partial_batches(depth).items():
            if batch not in found and len(under_way.verify) == tokens:
                found[batch] = under_way
        return found

    def partial_batches(self, depth: int) -> dict:
        """``{batch: RoundCosts}`` of the measurements at ``depth`` under way
        (see ``costs``' ``most``)."""
        found = {}
        left = [k for k, entry in self.entries.items() if isinstance(entry, dict) and "passes" in entry]
        for key in set(self._partial).union(left):
            batch, _, bucket = key.partition("x")
            under_way = self._under_way(key)
            if bucket == str(depth_bucket(depth)) and under_way is not None:
                found[int(batch)] = under_way.fastest
        return found


@dataclass
class _Partial:
    """A measurement spread over calls: the fastest of each part timed so
    far, the passes over all of them completed, and the next verify length
    of the pass under way."""

    fastest: Optional[RoundCosts] = None
    passes: int = 0
    next_length: int = 1
    started: float = field(default_factory=time.time)

    def go_on(self, timer: RoundTimer, most: int) -> RoundCosts:
        """Time the next ``most`` verify lengths of the pass (and the draft
        where the pass starts); the fastest of every part so far."""
        start = self.next_length
        end = min(start + most - 1, timer.verify_rows)
        timed = timer(range(start, end + 1), draft=start == 1, repeats=1)
        if self.fastest is None:
            self.fastest = timed
        else:
            old = self.fastest
            verify = list(old.verify)
            for n, seconds in zip(range(start, end + 1), timed.verify):
                if n <= len(verify):
                    verify[n - 1] = min(verify[n - 1], seconds)
                else:
                    verify.append(seconds)
            draft, one = old.draft, old.draft_one
            if start == 1:
                draft = min(draft, timed.draft)
                one = min((s for s in (one, timed.draft_one) if s is not None), default=None)
            self.fastest = RoundCosts(draft, verify, one, timed.drafts)
        self.next_length = end + 1
        if end == timer.verify_rows:
            self.passes, self.next_length = self.passes + 1, 1
        return self.fastest

    def entry(self, depth: int) -> dict:
        """What a profile's file keeps of it."""
        return dict(
            draft=self.fastest.draft,
            draft_one=self.fastest.draft_one,
            drafts=self.fastest.drafts,
            verify=self.fastest.verify,
            depth=depth,
            passes=self.passes,
            next_length=self.next_length,
            started=self.started,
            measured_at=time.time(),
        )

    @classmethod
    def from_entry(cls, entry) -> Optional["_Partial"]:
        """The measurement a well-formed ``entry`` keeps, else ``None``."""
        if not isinstance(entry, dict) or "passes" not in entry:
            return None
        verify, one, drafts = entry.get("verify"), entry.get("draft_one"), entry.get("drafts")
        passes, next_length = entry.get("passes"), entry.get("next_length")
        seconds = [entry.get("draft"), entry.get("started"), *([] if one is None else [one])]
        if not (
            isinstance(verify, list) and verify
            and all(isinstance(c, (int, float)) and 0 < c < math.inf for c in verify + seconds)
            and all(isinstance(n, int) for n in (drafts, passes, next_length))
            and drafts >= 1 and 0 <= passes < REPEATS and 1 <= next_length <= len(verify) + 1
        ):
            return None
        costs = RoundCosts(entry["draft"], verify, one, drafts)
        return cls(costs, passes, next_length, entry["started"])




@contextlib.contextmanager
def _locked(path: Path):
    """Holds ``path``'s lock (a file beside it) exclusively, among processes
    and threads alike, waiting ``LOCK_WAIT`` seconds at most. A profile is
    a cache: where the lock cannot be had (held that long by a stopped
    process, a file system without locks), the write goes on without it
    rather than stall a round or be lost."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        yield
    finally:
        os.close(fd)  # which releases the lock


def _well_formed(entry) -> bool:
    """A whole measurement's entry (not one under way, ``_Partial.entry``)
    with positive, finite seconds."""
    if not isinstance(entry, dict) or "passes" in entry:
        return False
    verify, drafts, one = entry.get("verify"), entry.get("drafts"), entry.get("draft_one")
    return (
        isinstance(verify, list)
        and isinstance(entry.get("measured_at"), (int, float))
        and isinstance(drafts, int) and drafts >= 1
        and all(
            isinstance(c, (int, float)) and 0 < c < math.inf
            for c in [entry.get("draft"), *([] if one is None else [one]), *verify]
        )
    )


def _costs(entry: dict) -> RoundCosts:
    return RoundCosts(entry["draft"], entry["verify"], entry.get("draft_one"), entry["drafts"])


def _entry_key(depth: int, batch: Optional[int]) -> str:
    bucket = str(depth_bucket(depth))
    return bucket if batch is None else f"{batch}x{bucket}"


def profile_path(key: str) -> Path:
    return user_cache_dir() / "verify-cost" / f"{key}.json"
