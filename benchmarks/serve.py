"""``mlx_lm.server`` as its console script runs it, for ``server_load.py``,
optionally with replayed acceptance (``MLX_DSPARK_REPLAY_TAU``, see
``speculative.replayed_acceptance``) for random-weight drafters, and a cap on
MLX's buffer cache (``MLX_DSPARK_BUFFER_CACHE_GB``) for servers that share one
device: each process otherwise keeps the memory it freed for itself, and
batched rounds pipelined (``MLX_DSPARK_SERVER_PIPELINE=1``), to compare
against rounds read one by one (the server's default).

Activates mlx-dspark explicitly, for installs whose ``.pth`` line Python does
not read (``pip install --target`` on ``PYTHONPATH``)."""

import contextlib
import os
import sys

from mlx_dspark import activation

activation.install()

from mlx_lm.server import main  # noqa: E402  (patched on import)

from speculative import replayed_acceptance  # noqa: E402

if __name__ == "__main__":
    tau = os.environ.get("MLX_DSPARK_REPLAY_TAU")
    block = int(os.environ.get("MLX_DSPARK_REPLAY_BLOCK", "7"))
    if os.environ.get("MLX_DSPARK_BUFFER_CACHE_GB"):
        import mlx.core as mx

        mx.set_cache_limit(int(float(os.environ["MLX_DSPARK_BUFFER_CACHE_GB"]) * 2**30))
    if os.environ.get("MLX_DSPARK_SERVER_PIPELINE"):
        from mlx_dspark.integration.batch import ServerBatchGenerator

        ServerBatchGenerator.PIPELINE = os.environ["MLX_DSPARK_SERVER_PIPELINE"] == "1"
    sys.argv[0] = "mlx_lm.server"
    with replayed_acceptance(float(tau), block) if tau else contextlib.nullcontext():
        main()
