"""Operations a decoding round puts in MLX's graph, against mlx-lm's own step.

On a device where the host's launching of kernels bounds a round (MLX-CUDA,
see BENCHMARKS.md), the host encodes every primitive of the graph it
evaluates. This counts them, which does not depend on the machine: mlx-lm's
``BatchGenerator`` decode step, the target's forward through the speculative
batch's caches (1 and ``k + 1`` rows a sequence) and through mlx-lm's, a
whole speculative round (the drafter's call, then the verify, verdict,
rollback and commit), at batch size 1 a round of the single-stream engine
(``engine_round``, fixed scheduler) and a pipelined round
(``round_pipelined``), and a round the policy parked (no drafts: the
target's step and the drafter taking in its hidden states); at batch size 1
also mlx-lm's ``generate_step`` (``generate_step``, a token) against a
round the single-stream engine's pacing parked (``engine_parked``). Views (reshapes, broadcasts, slices) are counted too;
on the device most of them launch nothing.

``--prompt-cache`` counts instead what a prompt's first ``next()`` evaluates
when it comes with a prompt cache, as ``mlx_lm.server`` inserts every request
after the first, against the same prompt without one: merging the cache into
the batch is the difference.

Gemma-4-12B's layer structure (48 layers, five sliding to one full) and the
released DSpark drafter's (5 layers, block 7) at widths divided by
``--scale``: widths do not change the graph.
"""

import argparse
import json
import re
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import LRUPromptCache

from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import FixedPolicy
from mlx_dspark.confidence.costs import RoundCosts
from mlx_dspark.confidence.schedulers import CostScheduler
from mlx_dspark.drafters import gemma4_dspark
from mlx_dspark.drafters.deepspec import DeepSpecDrafter
from mlx_dspark.drafters.deepspec_model import Model
from mlx_dspark.integration.server import fetch_nearest_cache
from mlx_dspark.speculative.engine import speculative_generate_step
from mlx_dspark.speculative.stats import SpeculativeStats

import shapes
from batch import prompts
from speculative import replayed_acceptance


def primitives(*arrays) -> Counter:
    """The primitives that evaluating ``arrays`` would run, by name."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return Counter(re.findall(r'label ="([^"]+)"', path.read_text()))


def launched(generator) -> list:
    """The primitives of each ``mx.async_eval`` one ``next()`` makes."""
    graphs, original = [], mx.async_eval

    def recording(*args):
        graphs.append(primitives(*args))
        return original(*args)

    mx.async_eval = recording
    try:
        generator.next()
    finally:
        mx.async_eval = original
    return graphs


def models(scale: int):
    config = shapes.target_config(scale)
    config.update(
        num_hidden_layers=48,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
    )
    target = shapes.make_target_from(config, dtype=mx.float32)
    network = Model(gemma4_dspark.ModelArgs.from_dict(shapes.drafter_config(config, "dspark", scale)))
    network.set_dtype(mx.float32)
    mx.eval(network.parameters())
    return target, DeepSpecDrafter(network, "gemma4", Path("<random dspark>")), config["vocab_size"]


class Parked:
    """A batch policy that never drafts."""

    name = "parked"

    def choose(self, rates, caps, depth: int, batch=None, most=None) -> int:
        return 0


def cache_arrays(caches) -> list:
    return [x for c in caches for x in c.state if isinstance(x, mx.array)]


def count(target, drafter, vocab, batch, drafts):
    row = {"batch": batch}
    batch_prompts = prompts(batch, 64, vocab, 0)
    plain = BatchGenerator(target, completion_batch_size=64)
    plain.insert(batch_prompts, max_tokens=[100] * batch)
    for _ in range(4):
        plain.next()
    row["plain_step"] = sum(sum(g.values()) for g in launched(plain))
    stock_cache = plain._generation_batch.prompt_cache
    logits = target(mx.array([[5]] * batch), cache=stock_cache)
    row["stock_forward_1"] = sum(primitives(logits, *cache_arrays(stock_cache)).values())

    spec = SpeculativeBatchGenerator(
        target, drafter, completion_batch_size=64, policy=FixedPolicy(),
        num_draft_tokens=drafts, pipeline=False,
    )
    spec.insert(batch_prompts, max_tokens=[1000] * batch)
    with replayed_acceptance(3.3, drafter.block_size):
        for _ in range(4):
            spec.next()
        draft, rest = launched(spec)
    row["round_draft"] = sum(draft.values())
    row["round_rest"] = sum(rest.values())
    row["round"] = row["round_draft"] + row["round_rest"]
    parked = SpeculativeBatchGenerator(
        target, drafter, completion_batch_size=64, policy=Parked(), pipeline=False
    )
    parked.insert(batch_prompts, max_tokens=[1000] * batch)
    for _ in range(4):
        parked.next()
    row["round_parked"] = sum(sum(g.values()) for g in launched(parked))
    if batch == 1:
        row["engine_round"] = engine_round(target, drafter, batch_prompts[0], drafts)
        row["round_pipelined"] = pipelined_round(target, drafter, batch_prompts, drafts)
        row.update(parked_against_stock(target, drafter, batch_prompts[0]))
    rows, anchors = spec._generation, spec._anchors()
    for n in (1, drafts + 1):
        out = spec._forward(rows, mx.repeat(anchors[:, None], n, axis=1))
        graph = primitives(out.logits, *cache_arrays(rows.target_cache))
        row[f"our_forward_{n}"] = sum(graph.values())
        mx.eval(out.logits, cache_arrays(rows.target_cache))
        for c in rows.target_cache:
            c.trim(n)
    return row


def engine_round(target, drafter, prompt, drafts, rounds=10) -> float:
    """Primitives a round of the single-stream engine evaluates (the mean
    over ``rounds`` rounds, with replayed acceptance)."""
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    with replayed_acceptance(3.3, drafter.block_size):
        steps = speculative_generate_step(
            mx.array(prompt, mx.uint32), target, drafter, max_tokens=1000,
            scheduler="fixed", num_draft_tokens=drafts, stats=stats,
        )
        while len(stats.history) < 4:
            next(steps)
        before = len(stats.history)

        def run():
            while len(stats.history) < before + rounds:
                next(steps)

        total = evaluated(run)
    return total / (len(stats.history) - before)


class NeverPays(CostScheduler):
    """The ``cost`` scheduler on costs under which no draft pays, even if
    every one were accepted: its pacing parks every round, never probing."""

    def __init__(self):
        super().__init__(None, cache_profiles=False, clock=None)
        self.table = RoundCosts(1.0, [0.01] + [100.0] * 15)

    def profile(self, timer):
        return SimpleNamespace(
            costs=lambda *_, most=None: self.table,
            known=lambda *_: self.table,
            measured=lambda *_: self.table,
        )


def parked_against_stock(target, drafter, prompt, tokens=128) -> dict:
    """Primitives a token of mlx-lm's ``generate_step`` evaluates, and a
    round of the single-stream engine that its pacing parked (the mean over
    ``tokens``, which cover two of the drafter's intakes of the parked
    rounds' taps), and by kind where they differ. Unpadded: the costs
    ``NeverPays`` gives pad no verify."""
    prompt = mx.array(prompt, mx.uint32)
    stock = generate_step(prompt, target, max_tokens=1000)
    stats = SpeculativeStats(drafter.name, drafter.block_size)
    parked = speculative_generate_step(
        prompt, target, drafter, max_tokens=1000, scheduler=NeverPays(), stats=stats
    )
    kinds = {}
    for name, steps in (("generate_step", stock), ("engine_parked", parked)):
        for _ in range(4):
            next(steps)
        kinds[name] = evaluated_kinds(lambda: [next(steps) for _ in range(tokens)])
    assert not any(r.proposed for r in stats.history)
    row = {name: sum(k.values()) / tokens for name, k in kinds.items()}
    extra = kinds["engine_parked"].copy()
    extra.subtract(kinds["generate_step"])
    row["engine_parked_extra"] = {k: n / tokens for k, n in sorted(extra.items()) if n}
    return row


def pipelined_round(target, drafter, batch_prompts, drafts, rounds=10) -> float:
    """Primitives a round evaluates when each round is launched before the
    one before it is read (the generator's default; the server reads them
    one by one): the mean over ``rounds`` rounds."""
    spec = SpeculativeBatchGenerator(
        target, drafter, completion_batch_size=64, policy=FixedPolicy(), num_draft_tokens=drafts,
    )
    stats = [SpeculativeStats(drafter.name, drafter.block_size) for _ in batch_prompts]
    spec.insert(batch_prompts, max_tokens=[1000] * len(batch_prompts), stats=stats)
    with replayed_acceptance(3.3, drafter.block_size):
        for _ in range(6):
            spec.next()
        before = len(stats[0].history)
        total = evaluated(lambda: [spec.next() for _ in range(rounds)])
    return total / (len(stats[0].history) - before)


def evaluated_kinds(call) -> Counter:
    """Primitives of every ``mx.eval`` and ``mx.async_eval`` ``call()``
    makes, by name."""
    total, originals = Counter(), (mx.eval, mx.async_eval)

    def recording(original):
        def record(*args):
            arrays = [x for _, x in tree_flatten(list(args)) if isinstance(x, mx.array)]
            total.update(primitives(*arrays))
            return original(*args)
        return record

    mx.eval, mx.async_eval = (recording(f) for f in originals)
    try:
        call()
    finally:
        mx.eval, mx.async_eval = originals
    return total


def evaluated(call) -> int:
    return sum(evaluated_kinds(call).values())


def count_prompt_cache(target, drafter, vocab, batch):
    """A first ``next()`` with and without a prompt cache per prompt: an
    earlier request ran to its end and left its cache in an
    ``LRUPromptCache``; the new prompts share its first 4 tokens."""
    row = {"batch": batch}
    generators = {
        "plain": (lambda: BatchGenerator(target, completion_batch_size=64),
                  LRUPromptCache.fetch_nearest_cache),
        "spec": (lambda: SpeculativeBatchGenerator(target, drafter, completion_batch_size=64,
                                                   policy=FixedPolicy()),
                 fetch_nearest_cache),
    }
    for name, (make, fetch) in generators.items():
        for cached in (False, True):
            generator = make()
            earlier = prompts(1, 8, vocab, 9)[0]
            new = [earlier[:4] + p[4:] for p in prompts(batch, 8, vocab, 5)]
            options = {}
            if cached:
                (uid,) = generator.insert([earlier], max_tokens=[4])
                lru, done = LRUPromptCache(), False
                while not done:
                    for r in generator.next()[1]:
                        if r.finish_reason:
                            lru.insert_cache("m", r.all_tokens[:], r.prompt_cache)
                            done = True
                fetched = [fetch(lru, "m", p) for p in new]
                options = dict(
                    caches=[c for c, _ in fetched],
                    all_tokens=[p[: len(p) - len(rest)] for p, (_, rest) in zip(new, fetched)],
                )
                new = [rest for _, rest in fetched]
            generator.insert(new, max_tokens=[4] * batch, **options)
            row[f"{name}_{'cached' if cached else 'uncached'}"] = evaluated(generator.next)
    return row


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", type=int, default=7)
    parser.add_argument("--prompt-cache", action="store_true", help="count a cached insert's first next()")
    args = parser.parse_args()
    target, drafter, vocab = models(args.scale)
    for b in args.batch:
        if args.prompt_cache:
            row = count_prompt_cache(target, drafter, vocab, b)
        else:
            row = count(target, drafter, vocab, b, args.drafts)
        print(json.dumps(row), flush=True)
