"""Where a speculative batch round's time goes, against plain batched decoding.

For each batch size: B prompts are prefilled, then ``--rounds`` rounds run
with every sequence verifying ``--drafts`` drafts (replayed acceptance at
``--tau``, see ``speculative.replayed_acceptance``). Each round is split into
host phases by wrapping the generator's calls (MLX is lazy, so a wrapped
call's time is the host building its graph): choosing the drafts, building
the drafter's graph and launching it (``async_eval``), building the verify
graph, waiting for the device in the verdict's evaluation, and the host's
bookkeeping after it. Then, on the
same caches, the device alone: a drafter call, a verify of ``B x (k + 1)``
rows and a ``B x 1`` step, each evaluated on its own; and mlx-lm's own
``BatchGenerator`` step for the same prompts. Last, what a finished request
costs: its caches handed back, and its row leaving (``handback_times``).

Each batch size runs twice: rounds read one by one (``serial``: a round
costs about ``build_draft + max(draft, build_verify) + verify + post``),
and ``pipelined``, round t+1 built while round t runs, which hides the
host's phases behind the device's. ``launch`` is a round's host time
(choosing, building and starting it), ``collect`` the wait for the device
and reading the verdict, ``step`` the whole ``next()`` round.
"""

import argparse
import contextlib
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import FixedPolicy

import shapes
from speculative import replayed_acceptance
from timing import backend, seconds


def prompts(n, length, vocab):
    return [[(i * 104729 + j * 131) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]


@contextlib.contextmanager
def timed(obj, name, phases, key):
    """Add the wall time of each ``obj.name(...)`` call to ``phases[key]``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        tic = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[key] += time.perf_counter() - tic

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        setattr(obj, name, original)


def plain_step_ms(model, batch, tokens):
    generator = BatchGenerator(model, completion_batch_size=64)
    generator.insert(batch, max_tokens=[tokens] * len(batch))
    with generator.stats() as measured:
        while generator.next_generated():
            pass
    return 1000 * measured.decode_time / measured.generation_steps


def phases_of(model, drafter, batch, drafts, rounds, tau, pipeline):
    generator = SpeculativeBatchGenerator(
        model, drafter, completion_batch_size=64, policy=FixedPolicy(),
        num_draft_tokens=drafts, pipeline=pipeline,
    )
    generator.insert(batch, max_tokens=[10**6] * len(batch))
    while len(generator._generation) < len(batch):
        generator.next()
    keys = ["choose", "build_draft", "launch_draft", "build_verify", "launch", "collect", "step"]
    phases = dict.fromkeys(keys, 0.0)
    with contextlib.ExitStack() as stack:
        stack.enter_context(replayed_acceptance(tau, drafter.block_size))
        stack.enter_context(timed(generator, "_choose_drafts", phases, "choose"))
        stack.enter_context(timed(drafter, "propose_batch", phases, "build_draft"))
        stack.enter_context(timed(mx, "async_eval", phases, "launch_draft"))
        stack.enter_context(timed(generator, "_forward", phases, "build_verify"))
        stack.enter_context(timed(generator, "_launch", phases, "launch"))
        stack.enter_context(timed(generator, "_collect", phases, "collect"))
        stack.enter_context(timed(generator, "_step", phases, "step"))
        for i in range(rounds + 3):
            if i == 3:  # after the warm-up rounds
                phases.update(dict.fromkeys(keys, 0.0))
            generator.next()
    result = {k: 1000 * v / rounds for k, v in phases.items()}
    result["other"] = result["step"] - result["launch"] - result["collect"]
    return generator, result


def device_times(generator, drafts):
    drafter = generator.drafter
    result = {}
    rows = generator._generation
    anchors = generator._anchors()

    def draft():
        return drafter.propose_batch(rows.draft_cache, anchors, drafts).tokens

    def verify(n):
        def run():
            out = generator._forward(rows, mx.repeat(anchors[:, None], n, axis=1))
            mx.eval(out.logits, [c.state for c in rows.target_cache])
            for c in rows.target_cache:
                c.trim(n)
            return out.logits[:, :0]
        return run

    result["device_draft"] = 1000 * seconds(draft)
    result["device_verify"] = 1000 * seconds(verify(drafts + 1))
    result["device_step"] = 1000 * seconds(verify(1))
    tic = time.perf_counter()
    out = generator._forward(rows, mx.repeat(anchors[:, None], drafts + 1, axis=1))
    result["host_verify_graph"] = 1000 * (time.perf_counter() - tic)
    mx.eval(out.logits)
    for c in rows.target_cache:
        c.trim(drafts + 1)
    return result


def handback_times(generator):
    """A finished request's hand-back and a row leaving, on the live rows:
    building every cache's extraction of one row (the host's graph),
    ``Rows.extract`` whole (build and launch), the device's wait after it;
    then, twice, the last row taken out of every cache (``Rows.keep``),
    launched and waited for, with the times of the rounds before and after.
    A best case: nothing else is in flight (in a server the hand-back is
    built while the server streams, and rounds may be pipelined)."""
    generator.pipeline = False
    generator.next()  # reads the round in flight: rows change between rounds only
    rows = generator._generation
    mx.eval([c.state for c in rows.caches()])
    build, extract, wait = [], [], []
    for i in range(len(rows)):
        end = len(rows.sequences[i].tokens)
        tic = time.perf_counter()
        [c.extract(i, end) for c in rows.caches()]
        build.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        caches = rows.extract(i)
        extract.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        mx.eval([c.state for c in caches])
        wait.append(time.perf_counter() - tic)
    result = {
        "caches": len(rows.caches()),
        "handback_build": 1000 * statistics.median(build),
        "handback_extract": 1000 * statistics.median(extract),
        "handback_wait": 1000 * statistics.median(wait),
    }
    for leave in range(min(2, len(rows) - 1)):
        before = rounds_ms(generator, 3)
        tic = time.perf_counter()
        rows.keep(list(range(len(rows) - 1)))
        result[f"leave{leave}_build"] = 1000 * (time.perf_counter() - tic)
        tic = time.perf_counter()
        mx.async_eval([c.state for c in rows.caches()])
        result[f"leave{leave}_launch"] = 1000 * (time.perf_counter() - tic)
        tic = time.perf_counter()
        mx.eval([c.state for c in rows.caches()])
        result[f"leave{leave}_wait"] = 1000 * (time.perf_counter() - tic)
        # The copies are done: what the rounds after still pay is not theirs.
        result[f"leave{leave}_rounds_before"] = before
        result[f"leave{leave}_rounds_after"] = rounds_ms(generator, 4)
    return result


def shape_times(generator, drafts):
    """Rounds at draft counts the batch has not verified yet, then the same
    counts again: what a new round shape's first use costs (kernels,
    plans and buffers made for it), against the same shape reused."""
    generator.pipeline = False
    generator.next()
    result = {}
    for run in ("first", "again"):
        for k in (5, 3, 1, 0, drafts):
            for s in generator._generation.sequences:
                s.num_draft_tokens = k
            result[f"shape_{run}_k{k}"] = rounds_ms(generator, 2)
    return result


def rounds_ms(generator, count):
    times = []
    for _ in range(count):
        tic = time.perf_counter()
        generator.next()
        times.append(round(1000 * (time.perf_counter() - tic), 1))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--drafts", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tau", type=float, default=3.3)
    parser.add_argument("--shapes", action="store_true", help="time new round shapes' first use")
    parser.add_argument("--json")
    args = parser.parse_args()

    model = shapes.make_target(args.scale)
    drafter = shapes.make_drafter(args.scale)
    vocab = shapes.target_config(args.scale)["vocab_size"]
    rows = []
    for n in args.batch:
        batch = prompts(n, args.context, vocab)
        plain_step_ms(model, batch, 8)  # warm-up
        row = {"batch": n, "backend": backend(), "context": args.context}
        row["plain_step"] = statistics.median(
            plain_step_ms(model, batch, 48) for _ in range(3)
        )
        for pipeline in (False, True):
            generator, phases = phases_of(
                model, drafter, batch, args.drafts, args.rounds, args.tau, pipeline
            )
            tag = "pipelined" if pipeline else "serial"
            row.update({f"{tag}_{k}": v for k, v in phases.items()})
        row.update(device_times(generator, args.drafts))
        if args.shapes:
            row.update(shape_times(generator, args.drafts))
        if n > 1:
            row.update(handback_times(generator))
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
