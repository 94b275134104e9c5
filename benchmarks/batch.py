"""mlx-lm's ``BatchGenerator`` (plain continuous batching) against the
speculative batch generator, in one process, at batch sizes 1..16.

Each batch size runs every generator in turn (``--repeats`` times, order
alternating): N sequences, each with its own prompt, generate
``--max-tokens`` tokens; the decode throughput is generation tokens over
decode time (prompt processing excluded), as mlx-lm's ``BatchStats``
reports it. Per batch size and generator: aggregate tokens/s, the ratio to
plain batching, and for the speculative ones tau and the mean drafts the
policy verified per round; a ``cost`` generator keeps one policy across
its runs, as ``mlx_lm.server`` keeps one across drains. ``--single``: at batch size 1, also the
single-stream engine (``speculative_generate_step``, fixed and cost
schedulers) on the same prompt, decode tokens over decode time alike (the
prompt and the first token excluded): what a single stream would gain or
lose as a batch of one. (With replayed acceptance the single stream's
rounds draw from the shared random stream, the batch's per prompt: both see
the same acceptance rate, not the same rounds.)

Default: the bundled tiny Gemma-4 pair (real acceptance); ``--drafter
assistant`` for the Gemma-4 assistant (the bundled dense tiny pair, or one at
the shapes below), which drafts a step a draft. ``--shapes 12b``
(or ``--scale N``): random weights at Gemma-4-12B shapes with **replayed
acceptance** at ``--tau`` (see ``speculative.replayed_acceptance``); with
random weights the policy's acceptance estimate follows the replayed rounds.
``--target-bits 4``: the target quantized as ``mlx_lm.convert -q`` does (on
MLX-CUDA the engine then verifies 2-8 rows in all by its multirow kernel,
where timed faster; the JSON says how many modules).
"""

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

import mlx_dspark
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import BatchPolicy, FixedPolicy
from mlx_dspark.progress import progress
from mlx_dspark.speculative.engine import speculative_generate_step
from mlx_dspark.speculative.stats import SpeculativeStats
from mlx_dspark.targets import multirow

import shapes
from speculative import TINY, replayed_acceptance

TINY_ASSISTANT = TINY.parent / "assistant-tiny" / "dense"
from timing import backend


def prompts(n, length, vocab, wave):
    return [
        [(wave * 7919 + i * 104729 + j * 131) % (vocab - 10) + 5 for j in range(length)]
        for i in range(n)
    ]


def run(make, prompts_, max_tokens, stats=None, like_server=False):
    """Decode tokens/s of one generator over ``prompts_``; ``like_server``:
    each response's log-probability of its token is read on the host, as
    ``mlx_lm.server`` does for every token it streams."""
    generator = make()
    kwargs = {"stats": stats} if stats is not None else {}
    generator.insert(prompts_, max_tokens=[max_tokens] * len(prompts_), **kwargs)
    with generator.stats() as measured:
        while responses := generator.next_generated():
            for r in responses if like_server else ():
                r.logprobs[r.token].item()
    generator.close()  # lets the next one have its policy, as the server's drains do
    return measured.generation_tokens / measured.decode_time


def run_single(model, drafter, prompt, max_tokens, scheduler, stats):
    """Decode tokens/s of the single-stream engine: from its first token
    (the prompt processed) to its last."""
    steps = speculative_generate_step(
        mx.array(prompt, mx.uint32), model, drafter, max_tokens=max_tokens,
        scheduler=scheduler, stats=stats,
    )
    next(steps)
    tic = time.perf_counter()
    tokens = sum(1 for _ in steps)
    return tokens / (time.perf_counter() - tic)


def pair(args):
    """The target, drafter and vocabulary size ``--shapes``, ``--scale`` and
    ``--drafter`` name: random weights at 12B shapes (divided by the scale),
    whose acceptance is replayed, or the bundled tiny pair."""
    if args.shapes or args.scale:
        scale = args.scale or 1
        make = shapes.make_assistant if args.drafter == "assistant" else shapes.make_drafter
        return shapes.make_target(scale), make(scale), shapes.target_config(scale)["vocab_size"]
    if args.drafter == "assistant":
        model, _ = load(str(TINY_ASSISTANT / "target"))
        return model, mlx_dspark.load_drafter(TINY_ASSISTANT / "assistant"), model.args.vocab_size
    model, _ = load(str(TINY / "target_tiny_gemma4"))
    return model, mlx_dspark.load_drafter(TINY / "dspark_tiny_gemma4_block4"), model.args.vocab_size


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=["12b"])
    parser.add_argument("--scale", type=int)
    parser.add_argument("--drafter", choices=["dspark", "assistant"], default="dspark")
    parser.add_argument("--tau", type=float, default=3.3)
    parser.add_argument("--target-bits", type=int, choices=[4, 8, 16], default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--like-server", action="store_true",
        help="as mlx_lm.server drives a batch generator: on the thread's default stream, "
        "each token's log-probability read on the host",
    )
    parser.add_argument("--serial", action="store_true", help="also both policies with rounds not pipelined")
    parser.add_argument("--single", action="store_true", help="at batch size 1, also the single-stream engine")
    parser.add_argument("--only", nargs="+", help="run only these generators (plain always runs)")
    parser.add_argument(
        "--calibration", type=Path,
        help="also the cost policy with the drafter calibrated by this file "
        "(rounds verified by their confidences; real acceptance only)",
    )
    parser.add_argument(
        "--python-hook", action="store_true",
        help="run with a no-op Python-level sys.setprofile hook, which slows every "
        "Python call (cProfile's hook is in C and cheaper): whether a slower host "
        "changes the rates (on an H200, the batch generators ran faster under cProfile)",
    )
    parser.add_argument(
        "--busy-cores", type=int, default=0,
        help="keep this many other processes spinning on the host's cores while it runs: "
        "whether the rates depend on how idle the host is (its cores' sleep states)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.python_hook:
        sys.setprofile(lambda frame, event, arg: None)
    # Each spinner also stops once this process is gone (killed by a timeout).
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.busy_cores)]
    try:
        measure(args, parser)
    finally:
        for spinner in spinners:
            spinner.kill()


def measure(args, parser):
    if args.single and 1 not in args.batch:
        parser.error("--single runs at batch size 1: include 1 in --batch")

    replay = args.shapes or args.scale
    model, drafter, vocab = pair(args)
    if args.target_bits != 16:
        shapes.quantize(model, args.target_bits)

    # mlx_lm.server runs its batch generator on the thread's default stream,
    # where its reads of each token's log-probability run too.
    stream = {"stream": mx.default_stream(mx.default_device())} if args.like_server else {}
    # Each cost generator's policy paces all its runs, the warm-up's too, as
    # mlx_lm.server's policy paces the batches after each drain: a fresh one
    # spends a run's first rounds learning what rounds cost.
    policies = {name: BatchPolicy() for name in ("cost", "cost-serial", "cost-calibrated")}
    generators = {
        "plain": lambda: BatchGenerator(model, completion_batch_size=64, **stream),
        "spec-cost": lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=policies["cost"], **stream
        ),
        "spec-fixed": lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=FixedPolicy(), **stream
        ),
    }
    if args.serial:
        generators["spec-cost-serial"] = lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=policies["cost-serial"], pipeline=False,
            **stream,
        )
        generators["spec-fixed-serial"] = lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=FixedPolicy(), pipeline=False,
            **stream,
        )
    if args.calibration:
        if replay or args.drafter != "dspark":
            parser.error("--calibration needs real acceptance and confidences (the bundled DSpark pair)")
        calibrated = mlx_dspark.load_drafter(
            TINY / "dspark_tiny_gemma4_block4", calibration=args.calibration
        )
        generators["spec-cost-calibrated"] = lambda: SpeculativeBatchGenerator(
            model, calibrated, completion_batch_size=64, policy=policies["cost-calibrated"],
            **stream
        )
    singles = {"single-fixed": "fixed", "single-cost": "cost"} if args.single else {}
    unknown = set(args.only or ()) - set(generators) - set(singles) - {"plain"}
    if unknown:
        parser.error(f"--only: no generator named {', '.join(sorted(unknown))}")
    results = []
    for n in args.batch:
        if n == 1:
            generators.update({name: None for name in singles})
        else:
            for name in singles:
                generators.pop(name, None)
        if args.only:
            for name in [g for g in generators if g != "plain" and g not in args.only]:
                generators.pop(name)
        speeds = {name: [] for name in generators}
        stats = {name: [] for name in generators if name != "plain"}
        order = list(generators)
        for r in progress(range(args.repeats + 1), desc=f"B={n}"):
            batch = prompts(n, args.context, vocab, r)
            for name in order if r % 2 else order[::-1]:
                if name == "plain":
                    speed = run(generators[name], batch, args.max_tokens, like_server=args.like_server)
                else:
                    per_row = [SpeculativeStats(drafter.name, drafter.block_size) for _ in batch]
                    with replayed_acceptance(args.tau, drafter.block_size, seed=r) if replay else contextlib.nullcontext():
                        if name in singles:
                            speed = run_single(
                                model, drafter, batch[0], args.max_tokens, singles[name], per_row[0]
                            )
                        else:
                            speed = run(generators[name], batch, args.max_tokens, per_row, args.like_server)
                    if r:
                        stats[name] += per_row
                if r:  # the first pass warms up
                    speeds[name].append(speed)
        row = {"batch": n, "backend": backend()}
        plain = statistics.median(speeds["plain"])
        for name, values in speeds.items():
            row[name] = statistics.median(values)
            row[f"{name}_ratio"] = row[name] / plain
        for name, per_row in stats.items():
            rounds = [r for s in per_row for r in s.history]
            row[f"{name}_tau"] = sum(r.acceptance_length for r in rounds) / max(1, len(rounds))
            row[f"{name}_drafts"] = sum(r.proposed for r in rounds) / max(1, len(rounds))
        results.append(row)
        print(
            f"B={n:<3} plain {plain:8.1f} tok/s | "
            + " | ".join(
                f"{name} {row[name]:8.1f} ({row[name + '_ratio']:.2f}x, tau "
                f"{row[name + '_tau']:.2f}, {row[name + '_drafts']:.1f} drafts)"
                for name in stats
            ),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "replayed": bool(replay), "multirow": multirow.routed_count(model), "results": results},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
