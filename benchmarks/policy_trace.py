"""What the batch cost policy chose, round by round, and how long the
rounds really took, against the fixed policy on the same prompts.

For each batch size: the speculative batch generator with the fixed policy,
then with the cost policy, then fixed again (one process, replayed or real
acceptance as ``batch.py``). Printed per policy: decode tokens/s, and by the
number of drafts a round verified, how many rounds and their median
realised time (the time ``SpeculativeBatchGenerator`` reports to the
policy); for the cost policy also the predicted time behind each choice and
the policy's overheads at the end. ``--rounds`` prints every cost round.
"""

import argparse
import contextlib
import json
import statistics
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

import mlx_dspark
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import BatchPolicy, FixedPolicy

import shapes
from batch import TINY_ASSISTANT, prompts, run
from speculative import TINY, replayed_acceptance


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
    parser.add_argument("--drafter", choices=["dspark", "assistant"], default="dspark")
    parser.add_argument("--tau", type=float, default=3.3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", action="store_true", help="print every round of the cost policy")
    parser.add_argument("--json")
    args = parser.parse_args()

    if args.shapes:
        make = shapes.make_assistant if args.drafter == "assistant" else shapes.make_drafter
        model, drafter = shapes.make_target(1), make(1)
        vocab = shapes.target_config(1)["vocab_size"]
    elif args.drafter == "assistant":
        model, _ = load(str(TINY_ASSISTANT / "target"))
        drafter = mlx_dspark.load_drafter(TINY_ASSISTANT / "assistant")
        vocab = model.args.vocab_size
    else:
        model, _ = load(str(TINY / "target_tiny_gemma4"))
        drafter = mlx_dspark.load_drafter(TINY / "dspark_tiny_gemma4_block4")
        vocab = model.args.vocab_size
    stream = {"stream": mx.default_stream(mx.default_device())}

    results = []
    for n in args.batch:
        for wave, make in enumerate([FixedPolicy, BatchPolicy, FixedPolicy]):
            policy = traced(make)()
            replay = replayed_acceptance(args.tau, drafter.block_size, seed=wave) if args.shapes else contextlib.nullcontext()
            with replay:
                speed = run(
                    lambda: SpeculativeBatchGenerator(model, drafter, completion_batch_size=64, policy=policy, **stream),
                    prompts(n, args.context, vocab, wave),
                    args.max_tokens,
                    like_server=True,
                )
            row = {"batch": n, "policy": policy.name, "wave": wave, "tokens_per_s": speed, "by_drafts": by_drafts(policy.rounds)}
            if policy.name == "cost":
                row["overheads_ms"] = {
                    f"{b} {'drafted' if d else 'plain'}": round(1000 * o, 2) for (b, d), o in policy.overheads.items()
                }
                row["change_of_shape_ms"] = round(1000 * policy.switch_cost, 2)
                if args.rounds:
                    row["rounds"] = policy.rounds
            results.append(row)
            print(f"B={n} {policy.name:<5} {speed:7.1f} tok/s  " + "  ".join(
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
