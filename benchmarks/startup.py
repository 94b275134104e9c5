"""What installing mlx-dspark costs a Python process that uses no drafter.

Times fresh interpreters of this environment, interleaved, in three set-ups:

- ``active``: as installed (the ``.pth`` hook adds an import hook, and
  importing ``mlx_lm.generate``/``mlx_lm.server`` applies the patches);
- ``disabled``: the same with ``MLX_DSPARK_DISABLE=1``;
- ``without``: a throwaway virtual environment that sees the same
  site-packages (and runs their other ``.pth`` files) but none of
  mlx-dspark's files.

Bytecode is written and warmed first, as after a normal install, whatever
``PYTHONDONTWRITEBYTECODE`` says. Each run reports wall-clock and CPU time
(user + system, all threads); on a shared machine the CPU time is the steadier.

    python benchmarks/startup.py [--runs 21] [--json]
"""

import argparse
import json
import os
import resource
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = {
    "python -c pass": "pass",
    "import mlx_lm.generate": "import mlx_lm.generate",
    "import mlx_lm.server": "import mlx_lm.server",
}
OURS = ("mlx_dspark.pth", "mlx_dspark.start", "_editable_impl_mlx_lm_dspark.pth")


def environment_without_us(root: Path) -> str:
    """A venv's interpreter whose site-packages lists this environment's
    site-packages, with the other ``.pth`` files, but not ours."""
    venv = [sys.executable, "-m", "venv", "--without-pip", str(root)]
    subprocess.run(venv, check=True)
    python = root / "bin" / "python"
    target = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    lines = []
    for directory in site.getsitepackages():
        lines.append(directory)
        for pth in sorted(Path(directory).glob("*.pth")):
            if pth.name in OURS:
                continue
            for line in pth.read_text().splitlines():
                if line.startswith(("import ", "import\t")):
                    lines.append(line)
                elif line.strip() and not line.startswith("#"):
                    lines.append(str(Path(directory, line.strip())))
    (Path(target) / "_startup_benchmark.pth").write_text("\n".join(lines) + "\n")
    return str(python)


def run_once(python: str, code: str, env: dict) -> tuple:
    """Wall-clock and CPU milliseconds of one interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([python, "-c", code], env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall * 1000, cpu * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    unset = ("MLX_DSPARK_DISABLE", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    with tempfile.TemporaryDirectory() as tmp:
        setups = {
            "active": (sys.executable, env),
            "disabled": (sys.executable, {**env, "MLX_DSPARK_DISABLE": "1"}),
            "without": (environment_without_us(Path(tmp) / "venv"), env),
        }
        # Also the warm-up: it writes the bytecode of what the commands import.
        probe = "import sys; print('mlx_dspark' in sys.modules)"
        for name, (python, environ) in setups.items():
            loaded = subprocess.run(
                [python, "-c", "import mlx_lm.server;" + probe],
                env=environ,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            assert loaded == str(name == "active"), (name, loaded)
        times = {(c, s): [] for c in COMMANDS for s in setups}
        for _ in range(args.runs):
            for command, code in COMMANDS.items():
                for name, (python, environ) in setups.items():
                    times[command, name].append(run_once(python, code, environ))

    results = {
        clock: {
            command: {
                name: statistics.median(t[i] for t in times[command, name])
                for name in setups
            }
            for command in COMMANDS
        }
        for i, clock in enumerate(("wall", "cpu"))
    }
    if args.json:
        print(json.dumps({"runs": args.runs, "median_ms": results}, indent=1))
        return
    header = ("without", "active", "disabled")
    for clock, rows in results.items():
        print(f"{clock} ms, median of {args.runs} interleaved runs")
        print(f"{'':24}" + "".join(f" {h:>9}" for h in header) + "  active/without")
        for command, row in rows.items():
            ratio = row["active"] / row["without"]
            print(
                f"{command:24} {row['without']:9.1f} {row['active']:9.1f} "
                f"{row['disabled']:9.1f} {ratio:15.3f}"
            )


if __name__ == "__main__":
    main()
