"""``mlx_lm.server`` as its console script runs it, for ``server_load.py``,
optionally with replayed acceptance (``MLX_DSPARK_REPLAY_TAU``, see
``speculative.replayed_acceptance``) for random-weight drafters.

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
    sys.argv[0] = "mlx_lm.server"
    with replayed_acceptance(float(tau), block) if tau else contextlib.nullcontext():
        main()
