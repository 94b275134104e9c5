"""What a round costs on this machine: one draft, and a verify of 1..n tokens,
at the current context depth.

Measuring takes a few dozen forwards, so profiles are kept on disk, one file
per target (architecture, shapes, quantization, dtype), drafter, MLX version
and device, one entry per context-depth bucket, re-measured when older than
``MAX_AGE`` or when a longer verify is needed.
"""

import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .calibration import user_cache_dir

MAX_AGE = 7 * 24 * 3600.0
REPEATS = 3


@dataclass
class RoundCosts:
    """Seconds for one draft and for verifying ``n`` tokens (``verify[n - 1]``)."""

    draft: float
    verify: List[float]

    def rounds_per_second(self, tokens: int) -> float:
        """Rounds per second when a round verifies ``tokens`` tokens."""
        return 1.0 / (self.draft + self.verify[tokens - 1])


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


@dataclass
class RoundTimer:
    """Times a round's parts on live caches. ``verify(n)`` runs the target on
    ``n`` tokens and ``draft()`` one proposal; both return what to evaluate
    and leave the caches as they found them."""

    model: nn.Module
    drafter: Any
    verify: Callable[[int], Any]
    draft: Callable[[], Any]

    @cached_property
    def key(self) -> str:
        identity = {
            "target": model_fingerprint(self.model),
            "drafter": getattr(self.drafter, "fingerprint", repr(self.drafter)),
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "device_info": mx.device_info(),
        }
        text = json.dumps(identity, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def __call__(self, tokens: int) -> RoundCosts:
        def seconds(fn):
            mx.eval(fn())
            times = []
            for _ in range(REPEATS):
                tic = time.perf_counter()
                mx.eval(fn())
                times.append(time.perf_counter() - tic)
            return statistics.median(times)

        return RoundCosts(
            draft=seconds(self.draft),
            verify=[seconds(partial(self.verify, n)) for n in range(1, tokens + 1)],
        )


class CostProfile:
    """Measured ``RoundCosts`` per depth bucket, for one timer key."""

    def __init__(self, path: Optional[Path], max_age: float = MAX_AGE):
        self.path = path
        self.max_age = max_age
        self.entries = self._read()

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
            return entries if isinstance(entries, dict) else {}
        except (AttributeError, OSError, ValueError):
            return {}

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            partial.write_text(json.dumps(self.entries, indent=1))
            partial.replace(self.path)
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time

    def costs(self, depth: int, tokens: int, timer: RoundTimer) -> RoundCosts:
        bucket = str(depth_bucket(depth))
        entry = self.entries.get(bucket)
        stale = (
            entry is None
            or len(entry.get("verify", ())) < tokens
            or time.time() - entry.get("measured_at", 0) > self.max_age
        )
        if stale:
            measured = timer(tokens)
            entry = dict(
                draft=measured.draft,
                verify=measured.verify,
                depth=depth,
                measured_at=time.time(),
            )
            self.entries[bucket] = entry
            self._write()
        return RoundCosts(entry["draft"], entry["verify"])


def profile_path(key: str) -> Path:
    return user_cache_dir() / "verify-cost" / f"{key}.json"
