"""What the batch cost policy chose, round by round, and how long the
rounds really took, against the fixed policy on the same prompts.

For each batch size: the speculative batch generator with the fixed policy,
then with the cost policy, then fixed again (one process, replayed or real
acceptance as ``batch.py``), each after an untimed run of its own policy on
other prompts (the cost profile measured, the policy's first rounds learnt). Printed per policy: decode tokens/s, and by the
number of drafts a round verified, how many rounds and their median
realised time (the time ``SpeculativeBatchGenerator`` reports to the
policy), the rounds' total and the seconds spent measuring costs (the rest
of a run is prefill and what no round is charged for); for the cost policy also the predicted time behind each choice and
the policy's overheads at the end. ``--rounds`` prints every cost round.
"""

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import BatchPolicy, FixedPolicy

from batch import pair, prompts, run
from speculative import replayed_acceptance


def traced(base):
    """``base`` recording each round's batch, drafts and depth as chosen,
    and the realised seconds the generator observes for it (rounds are
    observed in the order they were chosen)."""

    class Traced(base):
        def __init__(self):
            super().__init__()
            self.rounds, self._pending = [], []

        def choose(self, rates, caps, depth, batch=None, most=None):
            k = super().choose(rates, caps, depth, batch, most)
            chosen = getattr(self, "_chosen", None)
            self._pending.append({
                "batch": len(caps),
                "drafts": min(k, max(caps, default=0)),
                "depth": depth,
                "predicted": chosen[-1][-1] if chosen and chosen[-1] else None,
            })
            return k

        def observe(self, seconds):
            if hasattr(base, "observe"):
                super().observe(seconds)
            round_ = self._pending.pop(0) if self._pending else None
            if round_ is not None and seconds is not None:  # None: not the round's own time
                self.rounds.append(dict(round_, seconds=seconds))

    return Traced


def by_drafts(rounds):
    groups = defaultdict(list)
    for r in rounds:
        groups[r["drafts"]].append(r)
    return {
        k: {
            "rounds": len(rs),
            "median_ms": 1000 * statistics.median(r["seconds"] for r in rs),
            "predicted_ms": (
                1000 * statistics.median(r["predicted"] for r in rs)
                if all(r["predicted"] for r in rs) else None
            ),
        }
        for k, rs in sorted(groups.items())
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=["12b"])
    parser.add_argument("--scale", type=int, help="12B shapes divided by this (replayed acceptance)")
    parser.add_argument("--drafter", choices=["dspark", "assistant"], default="dspark")
    parser.add_argument("--tau", type=float, default=3.3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", action="store_true", help="print every round of the cost policy")
    parser.add_argument("--json")
    args = parser.parse_args()

    model, drafter, vocab = pair(args)
    stream = {"stream": mx.default_stream(mx.default_device())}

    results = []
    for n in args.batch:
        for wave, make in enumerate([FixedPolicy, BatchPolicy, FixedPolicy]):
            policy = traced(make)()
            replay = replayed_acceptance(args.tau, drafter.block_size, seed=wave) if args.shapes or args.scale else contextlib.nullcontext()
            made = []

            def generator():
                made.append(SpeculativeBatchGenerator(model, drafter, completion_batch_size=64, policy=policy, **stream))
                return made[-1]

            with replay:
                # Untimed, on other prompts: the costs' measurement and the
                # shapes' first uses, and the policy's first lessons, as a
                # server's policy has learnt them from its earlier batches.
                run(generator, prompts(n, args.context, vocab, 100 + wave), args.max_tokens, like_server=True)
                policy.rounds.clear()
                policy._pending.clear()
                speed = run(generator, prompts(n, args.context, vocab, wave), args.max_tokens, like_server=True)
            row = {
                "batch": n, "policy": policy.name, "wave": wave, "tokens_per_s": speed,
                "by_drafts": by_drafts(policy.rounds),
                "rounds_s": sum(r["seconds"] for r in policy.rounds),
                "measuring_s": made[-1]._measuring,
            }
            if policy.name == "cost":
                row["overheads_ms"] = {
                    f"{b} {'drafted' if d else 'plain'}": round(1000 * o, 2) for (b, d), o in policy.overheads.items()
                }
                row["change_of_shape_ms"] = round(1000 * policy.switch_cost, 2)
                if args.rounds:
                    row["rounds"] = policy.rounds
            results.append(row)
            print(f"B={n} {policy.name:<5} {speed:7.1f} tok/s  rounds {row['rounds_s']:.2f} s, measuring "
                  f"{row['measuring_s']:.2f} s  " + "  ".join(
                f"k={k}: {g['rounds']}x {g['median_ms']:.1f} ms"
                + (f" (pred {g['predicted_ms']:.1f})" if g["predicted_ms"] else "")
                for k, g in row["by_drafts"].items()
            ), flush=True)
            if "overheads_ms" in row:
                print(
                    f"      overheads (ms) {row['overheads_ms']}, a change of shape "
                    f"{row['change_of_shape_ms']} ms",
                    flush=True,
                )
            for r in row.get("rounds", []):
                print(f"      k={r['drafts']} depth {r['depth']} pred {1000 * (r['predicted'] or 0):.1f} ms real {1000 * r['seconds']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
