"""Time to first token in one process: mlx-lm's ``BatchGenerator`` against
the speculative batch generator, driven as ``mlx_lm.server`` drives them
(``next()`` until a request's first token comes back).

Two cases per ``--arrivals`` count N:

- ``idle``: N prompts inserted at once into an idle generator;
- ``joining``: the same N prompts inserted into a generator already decoding
  ``--running`` sequences;
- ``cached``: as ``mlx_lm.server`` serves a request after another: an
  earlier request sharing the first ``--shared`` tokens runs to its end and
  leaves its cache in an ``LRUPromptCache``; each new prompt takes the
  nearest cache from it and is inserted with it (``insert`` includes that
  fetch);
- ``after``: as ``cached``, but the new prompts are inserted without a
  cache (what a generator that has served a request costs by itself).

With ``--new-lengths`` the prompts are one token longer each pass, as the
server's requests vary (shapes the device has not run yet).

Reported per generator: the first and second token's latency after the
insert (p50 and max over the N requests and ``--repeats`` runs), how many
``next()`` calls the first token took, and where those calls' time went
(prefill chunks, a prompt's first step, decoding rounds, measuring costs),
from wrapping the generators' calls. MLX is lazy: a wrapped call's time is
its host work plus whatever it waits for on the device.

Default: the bundled tiny Gemma-4 pair. ``--scale N``: random weights at
Gemma-4-12B shapes divided by N (1: the real shapes) with replayed acceptance
at ``--tau`` (``speculative.replayed_acceptance``).
"""

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict

from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache

import mlx_dspark
from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import BatchPolicy, FixedPolicy
from mlx_dspark.integration.server import fetch_nearest_cache

import shapes
from batch import prompts
from batch_phases import timed
from speculative import TINY, replayed_acceptance
from timing import backend

# The calls whose time is split out, per generator class.
PHASES = {
    "plain": {},
    "spec": {
        "_prefill_chunk": "prefill",
        "_first_step": "first_step",
        "_step": "round",
        "measured_costs": "measuring",
    },
}


@contextlib.contextmanager
def timed_calls(generator, names, spent):
    """Add each named call's wall time to ``spent[phase]`` (``measuring``
    is part of ``round``: the policy measures costs inside a round)."""
    with contextlib.ExitStack() as stack:
        for name, phase in names.items():
            stack.enter_context(timed(generator, name, spent, phase))
        policy = getattr(generator, "policy", None)
        if getattr(policy, "costs", None) is not None:
            policy.costs = generator.measured_costs  # the policy's own reference
        yield


def drive_until_generating(generator, uids):
    waiting = set(uids)
    while waiting:
        _, responses = generator.next()
        waiting -= {r.uid for r in responses}


def cached_insert(generator, earlier, new, max_tokens, earlier_tokens=128, use_cache=True):
    """Run ``earlier`` to its end and keep its cache as the server does;
    returns ``insert(new)`` with each prompt's nearest cache (or, without
    ``use_cache``, with none)."""
    lru = LRUPromptCache()
    # The server's lookup: with a drafter, mlx-dspark's (which trims an entry
    # only as far as its caches roll back).
    fetch = LRUPromptCache.fetch_nearest_cache
    if isinstance(generator, SpeculativeBatchGenerator):
        fetch = fetch_nearest_cache
    (uid,) = generator.insert([earlier], max_tokens=[earlier_tokens])
    done = False
    while not done:
        _, responses = generator.next()
        for r in responses:
            if r.uid == uid and r.finish_reason is not None:
                lru.insert_cache("model", r.all_tokens[:], r.prompt_cache)
                done = True

    def insert():
        if not use_cache:
            return generator.insert(new, max_tokens=[max_tokens] * len(new))
        fetched = [fetch(lru, "model", p) for p in new]
        return generator.insert(
            [rest for _, rest in fetched],
            max_tokens=[max_tokens] * len(new),
            caches=[cache for cache, _ in fetched],
            all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(new, fetched)],
        )

    return insert


def first_tokens(generator, kind, new, running, max_tokens, earlier=None, earlier_tokens=128,
                 use_cache=True):
    """``(latencies of the first and second token per request, next() calls
    until every first token, seconds per phase)``."""
    insert = lambda: generator.insert(new, max_tokens=[max_tokens] * len(new))
    if earlier is not None:
        insert = cached_insert(generator, earlier, new, max_tokens, earlier_tokens, use_cache)
    if running:
        drive_until_generating(generator, generator.insert(running, max_tokens=[10**6] * len(running)))
        for _ in range(3):  # a few rounds of the running batch
            generator.next()
    spent = defaultdict(float)
    seen = defaultdict(list)
    calls = 0
    with timed_calls(generator, PHASES[kind], spent):
        tic = time.perf_counter()
        uids = insert()
        spent["insert"] = time.perf_counter() - tic
        while any(len(seen[u]) < 2 for u in uids):
            _, responses = generator.next()
            now = time.perf_counter() - tic
            if any(len(seen[u]) < 1 for u in uids):
                calls += 1
            for r in responses:
                if r.uid in uids and len(seen[r.uid]) < 2:
                    seen[r.uid].append(now)
        spent["total"] = time.perf_counter() - tic
    firsts = [seen[u][0] for u in uids]
    seconds_ = [seen[u][1] for u in uids]
    return firsts, seconds_, calls, dict(spent)


def summary(values):
    return {"p50_ms": 1000 * statistics.median(values), "max_ms": 1000 * max(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int)
    parser.add_argument("--tau", type=float, default=3.3)
    parser.add_argument("--arrivals", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--running-context", type=int, default=512)
    parser.add_argument("--shared", type=int, default=4, help="tokens a cached case's prompts share")
    parser.add_argument("--earlier-tokens", type=int, default=128, help="tokens the cached case's earlier request generates")
    parser.add_argument("--new-lengths", action="store_true", help="a new prompt length each pass")
    parser.add_argument("--cases", nargs="+", default=["idle", "joining", "cached", "after"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()

    if args.scale:
        model = shapes.make_target(args.scale)
        drafter = shapes.make_drafter(args.scale)
        vocab = shapes.target_config(args.scale)["vocab_size"]
    else:
        model, _ = load(str(TINY / "target_tiny_gemma4"))
        drafter = mlx_dspark.load_drafter(TINY / "dspark_tiny_gemma4_block4")
        vocab = model.args.vocab_size

    def replay(seed):
        if not args.scale:  # real acceptance
            return contextlib.nullcontext()
        return replayed_acceptance(args.tau, drafter.block_size, seed=seed)

    generators = {
        "plain": ("plain", lambda: BatchGenerator(model, completion_batch_size=64)),
        "spec-cost": ("spec", lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=BatchPolicy())),
        "spec-fixed": ("spec", lambda: SpeculativeBatchGenerator(
            model, drafter, completion_batch_size=64, policy=FixedPolicy())),
    }
    results = []
    for n in args.arrivals:
        for case in args.cases:
            measured = {name: defaultdict(list) for name in generators}
            for r in range(args.repeats + 1):  # the first pass warms up
                new = prompts(n, args.prompt_length, vocab, 100 + r)
                running = prompts(args.running, args.running_context, vocab, r) if case == "joining" else []
                earlier = None
                if args.new_lengths:  # each pass, as the server's requests come
                    new = prompts(n, args.prompt_length + r, vocab, 100 + r)
                if case in ("cached", "after"):
                    earlier = prompts(1, args.prompt_length, vocab, 200 + r)[0]
                    new = [earlier[: args.shared] + p[args.shared :] for p in new]
                order = list(generators) if r % 2 else list(generators)[::-1]
                for name in order:
                    kind, make = generators[name]
                    with replay(r):
                        firsts, seconds_, calls, spent = first_tokens(
                            make(), kind, new, running, 16, earlier, args.earlier_tokens,
                            use_cache=case == "cached")
                    if r:
                        m = measured[name]
                        m["first"] += firsts
                        m["second"] += seconds_
                        m["calls"].append(calls)
                        for phase, s in spent.items():
                            m[phase].append(s)
            row = {"arrivals": n, "case": case, "backend": backend()}
            for name, m in measured.items():
                row[name] = {
                    "first": summary(m["first"]),
                    "second": summary(m["second"]),
                    "calls": statistics.median(m["calls"]),
                    "phases_ms": {
                        phase: 1000 * statistics.mean(v)
                        for phase, v in m.items() if phase not in ("first", "second", "calls")
                    },
                }
            results.append(row)
            print(json.dumps(row, default=lambda x: round(x, 1)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
