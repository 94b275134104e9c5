"""Calibrating DSpark's confidence head: Sequential Temperature Scaling (paper
§3.2.1) and the per-position metrics DeepSpec reports (``confidence_head.py``).

The head gives one logit ``z_k`` per draft position: the chance that draft k
survives verification given that drafts ``1..k-1`` did. STS scales each
position's logit by its own temperature, ``c_k = σ(z_k / T_k)``, and predicts
that drafts ``1..k`` all survive with ``a_k = c_1 ⋯ c_k``. Fitting runs left to
right: ``T_k`` is the grid temperature that minimises the ECE of ``a_k``
against the prefix labels ``y_k = 1[drafts 1..k accepted]``, with
``T_1..T_{k-1}`` already fixed. Position k counts only the rounds that
verified draft k.
"""

import hashlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

FORMAT = "mlx-dspark-sts/1"
BINS = 20
MIN_ROUNDS = 20
# Log-spaced temperatures, symmetric around 1 (which is on the grid exactly).
GRID = 10.0 ** np.linspace(-math.log10(20.0), math.log10(20.0), 241)


@dataclass
class Rounds:
    """Verification rounds, as STS consumes them.

    Args:
        logits: ``[N, B]`` confidence logits (entries past ``verified`` are
            ignored).
        verified: ``[N]`` drafts each round verified.
        accepted: ``[N]`` drafts each round accepted (a prefix of those
            verified).
    """

    logits: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray

    @classmethod
    def from_history(cls, history, block_size: int) -> "Rounds":
        """From ``SpeculativeStats.history`` (rounds with confidences)."""
        rows = [r for r in history if r.confidence is not None]
        logits = np.zeros((len(rows), block_size))
        for i, r in enumerate(rows):
            logits[i, : len(r.confidence)] = r.confidence[:block_size]
        return cls(
            logits,
            np.array([min(r.proposed, block_size) for r in rows], dtype=np.int64),
            np.array([min(r.accepted, block_size) for r in rows], dtype=np.int64),
        )

    def __len__(self) -> int:
        return len(self.verified)

    def take(self, rows) -> "Rounds":
        return Rounds(self.logits[rows], self.verified[rows], self.accepted[rows])


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def kept_rates(
    logits: Sequence[float], temperatures: Optional[Sequence[float]] = None
) -> List[float]:
    """``σ(z_k / T_k)``: each draft's predicted chance of being kept once the
    drafts before it were (``T_k = 1`` without temperatures)."""
    z = np.asarray(logits, dtype=np.float64)
    if temperatures is not None:
        z = z / np.asarray(temperatures[: len(z)])
    return sigmoid(z).tolist()


def survival(
    logits: Sequence[float], temperatures: Optional[Sequence[float]] = None
) -> List[float]:
    """``a_k = Π_{i<=k} σ(z_i / T_i)`` for one round's logits (``T_i = 1``
    without temperatures)."""
    return np.cumprod(kept_rates(logits, temperatures)).tolist()


def expected_calibration_error(predicted, labels, bins: int = BINS):
    """``Σ_b (n_b / N) |mean(pred_b) - mean(label_b)|`` over equal-width bins
    on [0, 1]. ``predicted`` may be ``[G, N]``: one ECE per row."""
    predicted = np.atleast_2d(predicted)
    rows, n = predicted.shape
    index = np.minimum((predicted * bins).astype(np.int64), bins - 1)
    index += bins * np.arange(rows)[:, None]
    gap = np.bincount(
        index.ravel(),
        weights=(predicted - labels[None, :]).ravel(),
        minlength=rows * bins,
    )
    return np.abs(gap).reshape(rows, bins).sum(axis=1) / n


def auroc(predicted, labels) -> Optional[float]:
    """Area under the ROC curve (ties count half); ``None`` if one class is
    missing."""
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return None
    order = np.argsort(predicted, kind="mergesort")
    ranks = np.empty(len(predicted))
    sorted_values = predicted[order]
    # Average ranks over runs of equal predictions.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_values)) + 1]
    ends = np.r_[starts[1:], len(predicted)]
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2
    rank_sum = ranks[labels.astype(bool)].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def _position(rounds: Rounds, k: int):
    rows = rounds.verified > k
    return rows, (rounds.accepted[rows] > k).astype(np.float64)


def fit_sts(rounds: Rounds, grid=GRID, min_rounds: int = MIN_ROUNDS) -> List[float]:
    """Per-position temperatures, fitted left to right (see the module
    docstring). Positions verified in fewer than ``min_rounds`` rounds keep
    ``T = 1`` (a handful of labels would pick an extreme temperature); among
    equally good temperatures the one closest to 1 wins."""
    block = rounds.logits.shape[1]
    by_closeness = np.argsort(np.abs(np.log(grid)), kind="stable")
    temperatures = [1.0] * block
    prefix = np.ones(len(rounds))
    for k in range(block):
        rows, labels = _position(rounds, k)
        if rows.sum() < max(min_rounds, 1):
            break
        z, base = rounds.logits[rows, k], prefix[rows]
        candidates = base[None, :] * sigmoid(z[None, :] / grid[by_closeness, None])
        errors = expected_calibration_error(candidates, labels)
        temperatures[k] = float(grid[by_closeness[np.argmin(errors)]])
        prefix = prefix * sigmoid(rounds.logits[:, k] / temperatures[k])
    return temperatures


def predictions(rounds: Rounds, temperatures: Sequence[float]) -> np.ndarray:
    """``[N, B]`` predicted prefix survival ``a_k`` for every round."""
    block = rounds.logits.shape[1]
    return np.cumprod(sigmoid(rounds.logits / np.asarray(temperatures[:block])), axis=1)


def metrics(rounds: Rounds, temperatures: Sequence[float]) -> List[dict]:
    """Per position: rounds counted, acceptance rate, ECE, AUROC, Brier."""
    predicted = predictions(rounds, temperatures)
    report = []
    for k in range(rounds.logits.shape[1]):
        rows, labels = _position(rounds, k)
        if not rows.any():
            break
        p = predicted[rows, k]
        report.append(
            dict(
                position=k + 1,
                rounds=int(rows.sum()),
                accept_rate=float(labels.mean()),
                ece=float(expected_calibration_error(p, labels)[0]),
                auroc=auroc(p, labels),
                brier=float(np.mean((p - labels) ** 2)),
            )
        )
    return report


def weighted_mean(report: List[dict], key: str) -> Optional[float]:
    """The rounds-weighted mean of one metric over positions."""
    pairs = [(m["rounds"], m[key]) for m in report if m[key] is not None]
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total else None


FINGERPRINT_SAMPLES = 64
FINGERPRINT_CHUNK = 4096


def drafter_fingerprint(path: Path) -> str:
    """Identifies a drafter checkpoint: its config, and each weight file's
    name, size and content, sampled (its first bytes, which hold the tensor
    header, and evenly spaced chunks of the rest) so that a retrained or
    converted checkpoint of the same shapes gets a new one without reading
    gigabytes at every load."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(i * size // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()[:16]


# The settings ``user_cache_dir`` depends on.
CACHE_SETTINGS = ("MLX_DSPARK_CACHE", "XDG_CACHE_HOME", "HOME")


def user_cache_dir() -> Path:
    """Where mlx-dspark keeps calibrations and verify-cost profiles:
    ``$MLX_DSPARK_CACHE``, else ``$XDG_CACHE_HOME/mlx_dspark``, else
    ``~/.cache/mlx_dspark``."""
    if os.environ.get("MLX_DSPARK_CACHE"):
        return Path(os.environ["MLX_DSPARK_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx_dspark"


def default_calibration_path(fingerprint: str) -> Path:
    return user_cache_dir() / "calibration" / f"{fingerprint}.json"


@dataclass
class Calibration:
    """Fitted STS temperatures for one drafter checkpoint, and how they were
    obtained (``report``: metrics before and after, per position)."""

    temperatures: List[float]
    drafter: str  # drafter_fingerprint of the checkpoint calibrated
    target: str = ""
    sampling_temperature: float = 0.0
    rounds: int = 0
    report: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        """Write ``path`` whole or not at all (a file loading picks up must
        never be half written)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=1))
        partial.replace(path)

    @classmethod
    def load(cls, path: Path, fingerprint: str, block_size: int) -> "Calibration":
        """Read ``path``, checking that it was made for this drafter."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(
                f"No calibration file at {path}; make one with `mlx_dspark calibrate`."
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"The calibration file {path} cannot be read ({e})."
            ) from None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise ValueError(
                f"{path} is not an mlx-dspark calibration file (format {FORMAT})."
            )
        try:
            calibration = cls(**data)
        except TypeError as e:
            raise ValueError(
                f"The calibration file {path} is malformed ({e})."
            ) from None
        temps = calibration.temperatures
        if (
            not isinstance(temps, list)
            or len(temps) != block_size
            or not all(
                isinstance(t, (int, float)) and math.isfinite(t) and t > 0
                for t in temps
            )
        ):
            raise ValueError(
                f"The calibration file {path} needs {block_size} positive "
                f"temperatures for this drafter, it has {temps!r}."
            )
        if calibration.drafter != fingerprint:
            raise ValueError(
                f"The calibration file {path} was made for another drafter "
                "checkpoint (or another conversion of it); run `mlx_dspark "
                "calibrate` for this one."
            )
        return calibration


def resolve_calibration(option, fingerprint: str, block_size: int):
    """The calibration a drafter loads with: ``None`` picks up the one
    ``mlx_dspark calibrate`` saved for this checkpoint, if any (an unreadable
    one is skipped with a warning); a path loads that file; ``False`` means
    none."""
    if option is False:
        return None
    if option is not None:
        return Calibration.load(Path(option).expanduser(), fingerprint, block_size)
    path = default_calibration_path(fingerprint)
    if not path.exists():
        return None
    try:
        return Calibration.load(path, fingerprint, block_size)
    except ValueError as e:
        warnings.warn(f"Ignoring the saved calibration: {e}", stacklevel=2)
        return None
