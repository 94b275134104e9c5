"""Timing helpers shared by the benchmark scripts."""

import statistics
import time

import mlx.core as mx


def seconds(fn, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall-clock seconds of ``fn()``, its result evaluated."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def backend() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and mx.metal.is_available():
        return "metal"
    if device.type == mx.gpu:
        return "cuda"
    return "cpu"
