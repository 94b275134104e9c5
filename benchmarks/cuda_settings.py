"""MLX-CUDA's own settings against a speculative batch round's host time.

MLX-CUDA records kernels into CUDA graphs of at most ``MLX_MAX_OPS_PER_BUFFER``
nodes and keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated graphs for reuse;
a round that meets more distinct graphs than the cache holds instantiates
them again every round. This runs ``batch_phases.py`` once per setting, each
in a fresh process (the settings are read once, at first use), with MLX's
cache-thrashing warning on, and reports each setting's plain step, serial and
pipelined round, and the warnings the process printed.

    python cuda_settings.py --batch 1 16 --json settings.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

SETTINGS = {
    "default": {},
    "graph-cache-4000": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4000"},
    "graph-cache-4000-ops-100": {
        "MLX_CUDA_GRAPH_CACHE_SIZE": "4000",
        "MLX_MAX_OPS_PER_BUFFER": "100",
    },
    "no-graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}

KEYS = ["plain_step", "serial_step", "pipelined_step", "serial_launch", "device_verify", "device_step"]


def run(name, env, args):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable, "batch_phases.py", "--batch", *map(str, args.batch),
            "--rounds", str(args.rounds), "--scale", str(args.scale), "--json", out.name,
        ]
        environment = {**os.environ, "MLX_ENABLE_CACHE_THRASHING_CHECK": "1", **env}
        try:
            done = subprocess.run(
                command, env=environment, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"setting": name, "env": env, "error": f"over {args.timeout} s"}
        warnings = sorted({line for line in done.stderr.splitlines() if "thrashing" in line})
        if done.returncode:
            return {"setting": name, "env": env, "error": done.stderr[-2000:], "warnings": warnings}
        rows = json.load(open(out.name))["results"]
    return {
        "setting": name,
        "env": env,
        "warnings": warnings,
        "rows": [{"batch": r["batch"], **{k: round(r[k], 2) for k in KEYS}} for r in rows],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scale", type=int, default=1, help="shrink the 12B shapes (a CPU check)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--timeout", type=int, default=150, help="seconds per setting")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    for name in args.settings:
        results.append(run(name, SETTINGS[name], args))
        print(json.dumps(results[-1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
