"""The paired rows (``paired.py``'s JSON lines) as BENCHMARKS.md's table,
each against issue #14's goal: at least plain decoding's speed (a median
below 1.0 but within the slowest plain-against-plain pair of its row is
noise), an unquantized target's rows at 0.95 of their bound or more, and the
4-bit target with the Gemma-4 assistant at chat acceptance at 1.2x or more.

    python benchmarks/table.py benchmarks/results/h200-paired-*-s27.jsonl
"""

import argparse
import json

from mlx_dspark.confidence.costs import NO_CUDA_GRAPHS

AT_LEAST_BOUND = 0.95
ASSISTANT_4BIT_CHAT = 1.2
CHAT_TAU = 3.3

HEADER = (
    "| context | target | drafter | τ | scheduler | plain, spec tok/s | speedup (range) "
    "| plain vs plain | bound | ÷ bound | phases (verify + draft, host ms) | goal |\n"
    + "|---" * 12 + "|"
)


def verdicts(row: dict) -> list:
    """What the row misses of the goal (empty: it meets it)."""
    missed = []
    speedup, noise = row["speedup"], row["plain_vs_plain_range"][0]
    if speedup < 1.0:
        missed.append("slower than plain" if speedup < noise else "below 1.0, within plain's noise")
    if row["target_bits"] == 16 and row["speedup_over_bound"] < AT_LEAST_BOUND:
        missed.append(f"under {AT_LEAST_BOUND} of its bound")
    chat = row["replayed_tau"] == CHAT_TAU
    if row["target_bits"] == 4 and row["drafter"] == "assistant" and chat and speedup < ASSISTANT_4BIT_CHAT:
        missed.append(f"under {ASSISTANT_4BIT_CHAT}x")
    return missed


def other_launch_settings(row: dict) -> dict:
    """The row's MLX launch settings other than those the commands set for
    its target (CUDA graphs off for an unquantized one)."""
    commands = NO_CUDA_GRAPHS if row["target_bits"] == 16 else {}
    return {k: v for k, v in (row.get("launch_settings") or {}).items() if commands.get(k) != v}


def markdown(row: dict) -> str:
    low, high = row["speedup_range"]
    noise_low, noise_high = row["plain_vs_plain_range"]
    phase = row.get("round_phase_ms") or {}
    phases = (
        f"{phase['verify']:.1f} + {phase['draft']:.1f}, {phase['host']:.1f}"
        if {"verify", "draft", "host"} <= phase.keys() else "-"
    )
    share = f"{row['speedup_over_bound']:.2f}"
    if "speedup_over_bound_range" in row:  # per pair (rows before session 33: one bound)
        share += " ({:.2f}-{:.2f})".format(*row["speedup_over_bound_range"])
    cells = [
        row["context"],
        "bf16" if row["target_bits"] == 16 else f"{row['target_bits']}-bit",
        row["drafter"],
        row["replayed_tau"],
        f"`{row['scheduler']}`"
        + (f", probes {row['probe_share']}" if "probe_share" in row else "")
        + (", fresh" if row.get("fresh") else "")
        + (", multirow kernel" if row.get("multirow") else "")
        + "".join(f", {k}={v}" for k, v in other_launch_settings(row).items()),
        f"{row['plain_tok_s']:.1f}, {row['spec_tok_s']:.1f}",
        f"{row['speedup']:.2f}× ({low:.2f}-{high:.2f})",
        f"{noise_low:.2f}-{noise_high:.2f}",
        f"{row['bound_speedup']:.2f}×",
        share,
        phases,
        "; ".join(verdicts(row)) or "met",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="paired.py's JSON lines files")
    args = parser.parse_args()
    print(HEADER)
    for path in args.results:
        with open(path) as f:
            for line in f:
                if line.strip():
                    print(markdown(json.loads(line)))


if __name__ == "__main__":
    main()
