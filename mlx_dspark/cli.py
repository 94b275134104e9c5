"""The ``mlx_dspark`` command.

``mlx_dspark generate ...`` and ``mlx_dspark server ...`` are mlx-lm's own
``mlx_lm.generate`` and ``mlx_lm.server`` with mlx-dspark activated
explicitly: every mlx-lm flag passes through. They work without the
auto-activation (for example with ``MLX_DSPARK_DISABLE=1``, or on Python
versions that no longer run ``.pth`` import lines). mlx-dspark's own
commands (``convert``, ``calibrate``, ``doctor``, ``costs``, ``prepare``, ``train``,
``evaluate``) are modules with a ``main(argv)``.
"""

import importlib
import sys

MLX_LM_COMMANDS = {"generate": "mlx_lm.generate", "server": "mlx_lm.server"}
OWN_COMMANDS = {
    "convert": "mlx_dspark.convert",
    "calibrate": "mlx_dspark.confidence.calibrate",
    "doctor": "mlx_dspark.doctor",
    "costs": "mlx_dspark.batching.measure",
    "prepare": "mlx_dspark.training.prepare",
    "train": "mlx_dspark.training.train",
    "evaluate": "mlx_dspark.training.evaluate",
}

USAGE = """\
usage: mlx_dspark {generate,server,convert,calibrate,doctor,costs,prepare,train,evaluate} [flags ...]

  generate   mlx_lm.generate with hidden-state drafters (--draft-model)
  server     mlx_lm.server with hidden-state drafters (--draft-model)
  convert    write a quantized (--q-bits) or re-typed (--dtype) drafter
  calibrate  fit a DSpark drafter's confidence calibration (STS) on prompts
  doctor     check the install and a pair, and whether speculation pays here
  costs      measure ahead the round costs the cost scheduler and the
             server's batch policy need
  prepare    record a target's answers and hidden states for training
  train      train a DSpark or DFlash drafter for a target
  evaluate   report drafters' acceptance length tau on prompts

Run `mlx_dspark COMMAND --help` for its flags."""


def main():
    from .distribution import warn_about_other_providers

    warn_about_other_providers()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        return 0 if len(sys.argv) >= 2 else 2
    command = sys.argv.pop(1)
    if command in OWN_COMMANDS:
        return importlib.import_module(OWN_COMMANDS[command]).main(sys.argv[1:])
    if command not in MLX_LM_COMMANDS:
        print(
            f"mlx_dspark: error: unknown command {command!r}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    from .integration import patch_module

    module = importlib.import_module(MLX_LM_COMMANDS[command])
    if not patch_module(module):
        return 1
    sys.argv[0] = f"mlx_dspark {command}"
    return module.main()


if __name__ == "__main__":
    sys.exit(main())
