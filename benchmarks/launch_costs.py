"""What the host pays to launch each part of a speculative round.

On MLX-CUDA a round is bound by the host's launching of kernels, not by the
device (BENCHMARKS.md, ``batch_phases.py``): a round's launch took the host
26 ms at one sequence against 11 ms for mlx-lm's decode step, with only 1.28x
its primitives (``graph_size.py``). This finds which kind of work is dear to
launch. With the device idle before each part, it times the host building
the part's graph (Python), launching it (``mx.async_eval``) and the device
finishing it, and counts the primitives it evaluates:

- ``mlx_lm_step``: the target's step through mlx-lm's own caches;
- ``forward_1`` and ``forward_k``: the target's forward of 1 and ``k + 1``
  rows a sequence through the speculative batch's caches;
- ``draft``: the drafter's call for ``k`` drafts;
- ``verdict``: judging a verify's logits, rolling the caches back and the
  drafter taking in the kept taps (the verify itself already evaluated);
- ``draft_then_verify``: the verify launched while the drafter runs;
- ``round``: a whole round as ``next()`` launches it, and the same with
  the drafts launched with the verify (``round_one_launch``) or evaluated
  before it is built (``round_drafts_first``); ``next_*``: the median
  ``next()`` of each.

``--ops`` then launches many copies of one kind of operation at the round's
shapes (matmuls, attention with and without a mask, slice updates, gathers,
elementwise work) and reports the host's launch time per operation of each
kind. ``--fusion`` times 48 layers' projections as separate matmuls
against q/k/v and gate/up fused, and how long a launch of many
device-heavy operations holds the host (MLX's throttle).
"""

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_dspark.batching.generator import SpeculativeBatchGenerator
from mlx_dspark.batching.policy import FixedPolicy
from mlx_dspark.speculative.decoding import judge_greedy

import shapes
from batch_phases import prompts
from graph_size import primitives
from timing import backend


def launch(build, undo=None, setup=None, repeats=10):
    """Median milliseconds of the host building ``build()``'s graph, the
    host launching it (every ``mx.async_eval``, also those ``build`` makes)
    and the device finishing after that, each repeat from an idle device;
    and the primitives launched."""
    original, rows, kinds, calls = mx.async_eval, [], Counter(), []
    for i in range(repeats + 2):
        if setup is not None:
            setup()
        mx.synchronize()
        inside, each = 0.0, []

        def timed_async_eval(*args):
            nonlocal inside
            if i == 0:
                arrays = [x for _, x in tree_flatten(list(args)) if isinstance(x, mx.array)]
                kinds.update(primitives(*arrays))
            tic = time.perf_counter()
            original(*args)
            each.append(time.perf_counter() - tic)
            inside += each[-1]

        mx.async_eval = timed_async_eval
        try:
            tic = time.perf_counter()
            mx.async_eval(build())
            launched = time.perf_counter()
        finally:
            mx.async_eval = original
        mx.synchronize()
        done = time.perf_counter()
        if undo is not None:
            undo()
        if i >= 2:
            rows.append((launched - tic - inside, inside, done - launched))
            calls.append(each)
    build_s, launch_s, wait_s = (statistics.median(x) for x in zip(*rows))
    each_ms = [1000 * statistics.median(c) for c in zip(*calls)]
    count = sum(kinds.values())
    return {
        "build_ms": 1000 * build_s,
        "launch_ms": 1000 * launch_s,
        "wait_ms": 1000 * wait_s,
        "primitives": count,
        "launch_us_per_primitive": 1e6 * launch_s / max(count, 1),
        "each_launch_ms": each_ms,
        "kinds": dict(kinds.most_common()),
    }


def parts(model, drafter, batch_prompts, drafts):
    generator = SpeculativeBatchGenerator(
        model, drafter, completion_batch_size=64, policy=FixedPolicy(),
        num_draft_tokens=drafts, pipeline=False,
    )
    generator.insert(batch_prompts, max_tokens=[10**6] * len(batch_prompts))
    while len(generator._generation) < len(batch_prompts):
        generator.next()
    for _ in range(3):
        generator.next()
    rows = generator._generation
    anchors = generator._anchors()
    mx.eval(anchors)
    B = len(batch_prompts)
    result = {}

    def undone(caches, undo):
        # Undone on the device before the next part, whose launch (and
        # primitive count) would take the undo in otherwise.
        return lambda: (undo(), mx.eval([c.state for c in caches]))

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(batch_prompts), cache=cache))
    result["mlx_lm_step"] = launch(
        lambda: [model(anchors[:, None], cache=cache)] + [c.state for c in cache],
        undone(cache, lambda: [c.trim(1) for c in cache]),
    )

    def forward(n):
        def build():
            out = generator._forward(rows, mx.repeat(anchors[:, None], n, axis=1))
            return [out.logits, *out.hidden] + [c.state for c in rows.target_cache]
        return build

    def trim(n):
        return undone(rows.target_cache, lambda: [c.trim(n) for c in rows.target_cache])

    result["forward_1"] = launch(forward(1), trim(1))
    result["forward_k"] = launch(forward(drafts + 1), trim(drafts + 1))

    def draft():
        # The drafter's block is written and trimmed again: nothing to undo.
        proposal = drafter.propose_batch(rows.draft_cache, anchors, drafts)
        return [proposal.tokens] + [c.state for c in rows.draft_cache]

    result["draft"] = launch(draft)

    def draft_then_verify():
        # The verify launched while the drafter runs, its input pending.
        proposal = drafter.propose_batch(rows.draft_cache, anchors, drafts)
        mx.async_eval(proposal.tokens)
        inputs = mx.concatenate([anchors[:, None], proposal.tokens], axis=1)
        out = generator._forward(rows, inputs)
        return [out.logits, *out.hidden] + [c.state for c in rows.target_cache]

    result["draft_then_verify"] = launch(draft_then_verify, trim(drafts + 1))

    proposal = drafter.propose_batch(rows.draft_cache, anchors, drafts)
    mx.eval(proposal.tokens)
    inputs = mx.concatenate([anchors[:, None], proposal.tokens], axis=1)
    state = {}

    def verify():
        state["cursors"] = [c._idx for c in rows.caches()]
        out = generator._forward(rows, inputs)
        mx.eval(out.logits, out.hidden, [c.state for c in rows.caches()])
        state["out"] = out

    def verdict():
        out = state["out"]
        counts = mx.full((B,), drafts, mx.int32)
        log_probs, accepted, tokens = judge_greedy(proposal.tokens, out.logits, counts)
        rejected = drafts - accepted
        for c in rows.target_cache:
            c.rollback(rejected)
        drafter.commit(rows.draft_cache, out.hidden, proposal)
        for c in rows.draft_cache:
            c.rollback(rejected)
        state["accepted"] = accepted
        return [log_probs, accepted, tokens] + [c.state for c in rows.caches()]

    def undo_verdict():
        # Every row wrote drafts + 1 slots at the cursor: all of them go.
        accepted = state.pop("accepted").tolist()
        rows.settle([drafts - a for a in accepted], reuse=False)
        rows.trim_rows([a + 1 for a in accepted])
        for c, cursor in zip(rows.caches(), state.pop("cursors")):
            c._idx = cursor
        mx.eval([c.state for c in rows.caches()])

    result["verdict"] = launch(verdict, undo_verdict, setup=verify, repeats=5)

    def whole_round():
        launched = generator._launch(generator._anchors())
        state["launched"] = launched
        return launched.outputs() + [launched.anchors]

    def read_round():
        generator._collect(state.pop("launched"), reuse=True)
        mx.eval([c.state for c in rows.caches()])

    result["round"] = launch(whole_round, read_round)
    for tag, how in (("round_one_launch", None), ("round_drafts_first", mx.eval)):
        # Inside the timing's own wrapper, so that each launch counts once.
        def variant(how=how):
            with drafts_launched(how):
                return whole_round()

        result[tag] = launch(variant, read_round)
    for tag, how in (("next_ms", "keep"), ("next_one_launch_ms", None), ("next_drafts_first_ms", mx.eval)):
        with drafts_launched(how) if how != "keep" else contextlib.nullcontext():
            result[tag] = next_ms(generator, 20)
    result["batch"] = B
    return result


@contextlib.contextmanager
def drafts_launched(how):
    """A round's drafts, launched on their own (``mx.async_eval`` of the
    proposal's tokens), instead not launched (``how`` None: the verify's
    launch starts them) or evaluated (``mx.eval``: the host waits for them
    before it builds the verify)."""
    original = mx.async_eval

    def skipping(*args):
        if len(args) == 1 and isinstance(args[0], mx.array) and args[0].dtype == mx.uint32:
            return None if how is None else how(*args)
        return original(*args)

    mx.async_eval = skipping
    try:
        yield
    finally:
        mx.async_eval = original


def next_ms(generator, count):
    """Median milliseconds of a round read one by one (``next()``)."""
    times = []
    for i in range(count + 3):
        tic = time.perf_counter()
        generator.next()
        if i >= 3:
            times.append(time.perf_counter() - tic)
    return 1000 * statistics.median(times)


def op_shapes(batch, rows, context, scale):
    dtype = mx.bfloat16
    hidden, heads, kv_heads, head_dim, ffn = 3840 // scale, 16, 8, 256 // scale, 15360 // scale
    x = mx.random.normal((batch, rows, hidden)).astype(dtype)
    w = mx.random.normal((hidden, hidden)).astype(dtype) * 0.01
    w_up = mx.random.normal((ffn, hidden)).astype(dtype) * 0.01
    q = mx.random.normal((batch, heads, rows, head_dim)).astype(dtype)
    k = mx.random.normal((batch, kv_heads, context, head_dim)).astype(dtype)
    v = mx.random.normal((batch, kv_heads, context, head_dim)).astype(dtype)
    bool_mask = mx.random.uniform(shape=(batch, 1, rows, context)) > 0.1
    positions = mx.broadcast_to(mx.arange(context, dtype=mx.int32), (batch, context))
    index = mx.broadcast_to(mx.arange(context)[None, None, :, None], (batch, kv_heads, context, 1))
    logits = mx.random.normal((batch, rows, 262144 // scale)).astype(dtype)
    norm_weight = mx.ones((hidden,), dtype)
    mx.eval(x, w, w_up, q, k, v, bool_mask, positions, index, logits, norm_weight)
    attention_scale = head_dim ** -0.5
    return {
        "add": lambda i: x + i,
        "add_views": lambda i: (x + i).reshape(batch, rows, 16, -1).transpose(0, 2, 1, 3).reshape(batch, -1),
        "matmul_hidden": lambda i: (x + i) @ w,
        "matmul_ffn": lambda i: (x + i) @ w_up.T,
        "rms_norm": lambda i: mx.fast.rms_norm(x + i, norm_weight, 1e-6),
        "rope": lambda i: mx.fast.rope(q + i, head_dim, traditional=False, base=1e4, scale=1.0, offset=context),
        "sdpa_no_mask": lambda i: mx.fast.scaled_dot_product_attention(q + i, k, v, scale=attention_scale),
        "sdpa_causal": lambda i: mx.fast.scaled_dot_product_attention(q + i, k, v, scale=attention_scale, mask="causal"),
        "sdpa_bool_mask": lambda i: mx.fast.scaled_dot_product_attention(q + i, k, v, scale=attention_scale, mask=bool_mask),
        "slice_update": lambda i: _slice_update(k, q[:, :kv_heads] + i, context - rows),
        "take_along_axis": lambda i: mx.take_along_axis(k + i, index, axis=2),
        "compare_where": lambda i: mx.where(positions >= i, -1, positions),
        "argmax_vocab": lambda i: mx.argmax(logits + i, axis=-1),
        "logsumexp_vocab": lambda i: mx.logsumexp(logits + i, axis=-1),
    }


def _slice_update(buffer, new, at):
    out = mx.array(buffer)
    out[:, :, at : at + new.shape[2]] = new
    return out


def op_costs(batch, rows, context, copies, scale):
    """Host launch microseconds per copy of each kind of operation (an
    ``add`` of a distinct scalar in front of each, counted apart)."""
    result = {}
    for name, make in op_shapes(batch, rows, context, scale).items():
        def build():
            return [make(float(i) * 1e-3) for i in range(copies)]
        timing = launch(build, repeats=5)
        result[name] = {
            "launch_us_per_copy": 1000 * timing["launch_ms"] / copies,
            "primitives_per_copy": timing["primitives"] / copies,
            "launch_us_per_primitive": timing["launch_us_per_primitive"],
            "device_us_per_copy": 1000 * timing["wait_ms"] / copies,
        }
    return result


def fusion_costs(batch, rows, layers=48):
    """Launch milliseconds of 48 layers' projections at the 12B widths,
    each its own matmul (q, k, v, o, gate, up, down) against q/k/v in one
    matmul and gate/up in one (the same arithmetic, three fewer matmuls
    a layer)."""
    dtype = mx.bfloat16
    hidden, q_dim, kv_dim, ffn = 3840, 4096, 2048, 15360
    x = mx.random.normal((batch, rows, hidden)).astype(dtype)

    def weight(n, k):
        return (mx.random.normal((n, k)) * 0.01).astype(dtype)

    wq, wk, wv, wo = weight(q_dim, hidden), weight(kv_dim, hidden), weight(kv_dim, hidden), weight(hidden, q_dim)
    wg, wu, wd = weight(ffn, hidden), weight(ffn, hidden), weight(hidden, ffn)
    wqkv, wgu = mx.concatenate([wq, wk, wv]), mx.concatenate([wg, wu])
    mx.eval(x, wq, wk, wv, wo, wg, wu, wd, wqkv, wgu)

    def separate():
        h = x
        for _ in range(layers):
            q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
            h = h + (q * (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))) @ wo.T
            h = h + (nn_gelu(h @ wg.T) * (h @ wu.T)) @ wd.T
        return [h]

    def fused():
        h = x
        for _ in range(layers):
            q, k, v = mx.split(h @ wqkv.T, [q_dim, q_dim + kv_dim], axis=-1)
            h = h + (q * (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))) @ wo.T
            g, u = mx.split(h @ wgu.T, 2, axis=-1)
            h = h + (nn_gelu(g) * u) @ wd.T
        return [h]

    return {"separate": launch(separate, repeats=5), "fused": launch(fused, repeats=5)}


def nn_gelu(x):
    return x * mx.sigmoid(1.702 * x)


def throttle(copies):
    """Launch and wait milliseconds of ``copies`` operations that each keep
    the device busy far longer than the host takes to launch them: a launch
    that lasts about as long as the device's work is being held back."""
    x = mx.random.normal((8, 8, 768, 256)).astype(mx.bfloat16)
    index = mx.broadcast_to(mx.arange(768)[None, None, :, None], (8, 8, 768, 1))
    mx.eval(x, index)
    return launch(lambda: [mx.take_along_axis(x + i, index, axis=2) for i in range(copies)], repeats=3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--drafts", type=int, default=7)
    parser.add_argument("--ops", action="store_true", help="launch costs of single kinds of operation")
    parser.add_argument("--copies", type=int, default=200)
    parser.add_argument("--fusion", action="store_true", help="separate against fused projections, and the launch throttle")
    parser.add_argument("--no-parts", action="store_true", help="skip the round's parts")
    parser.add_argument("--json")
    args = parser.parse_args()

    results = {"args": vars(args), "backend": backend(), "parts": [], "ops": []}
    if not args.no_parts:
        model = shapes.make_target(args.scale)
        drafter = shapes.make_drafter(args.scale)
        vocab = shapes.target_config(args.scale)["vocab_size"]
    for n in args.batch if not args.no_parts else ():
        row = parts(model, drafter, prompts(n, args.context, vocab), args.drafts)
        results["parts"].append(row)
        print(json.dumps(row, default=lambda v: round(v, 3)), flush=True)
    if args.ops:
        for n in args.batch:
            for rows in (1, args.drafts + 1):
                row = {"batch": n, "rows": rows,
                       **op_costs(n, rows, args.context, args.copies, args.scale)}
                results["ops"].append(row)
                print(json.dumps(row, default=lambda v: round(v, 3)), flush=True)
    if args.fusion:
        for n in args.batch:
            row = {"batch": n, **fusion_costs(n, args.drafts + 1)}
            results.setdefault("fusion", []).append(row)
            print(json.dumps({k: v if not isinstance(v, dict) else {m: v[m] for m in ("build_ms", "launch_ms", "wait_ms", "primitives")} for k, v in row.items()}, default=lambda v: round(v, 2)), flush=True)
        for copies in (100, 1000, 3000):
            row = {"copies": copies, **throttle(copies)}
            row.pop("kinds")
            results.setdefault("throttle", []).append(row)
            print(json.dumps(row, default=lambda v: round(v, 2)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
