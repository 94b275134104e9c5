"""A target's verify by rows with its attention's q/k/v projections fused
into one matmul, and its MLP's gate and up projections into another.

On MLX-CUDA a 4-bit matmul of 8-16 rows took 2-2.6x its one-row time where
it had few output tiles to spread (``quantized_rows.py``; an H100, the 12B's
k, v, o and down projections), while the same matmuls side by side took no
longer than one row. A fused projection has more output tiles in one kernel.
Its outputs are the same dot products: on the CPU, bit for bit. This times
the 12B-shaped target's verify (on the engine's caches, at ``--context``)
at each of ``--rows`` as it is and fused, and reports how far the fused
logits moved. JSON lines to stdout (and ``--out``).

    python fused_projections.py --bits 4 --rows 1 8 16
"""

import argparse
import json
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

import shapes
from mlx_dspark.plugins import find_target_adapter
from timing import backend, seconds

FUSED = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class FusedProjection(nn.Module):
    """Linear maps of one input, without biases, as one (quantized alike, or
    not at all); its parts' first call for an input computes all of their
    outputs, and the last one's lets them go."""

    def __init__(self, linears):
        super().__init__()
        first = linears[0]
        if any("bias" in linear for linear in linears):
            raise ValueError("fuses projections without biases only")
        if isinstance(first, nn.QuantizedLinear):
            size = first.group_size
            self.linear = nn.QuantizedLinear(
                size, size, bias=False, group_size=size, bits=first.bits, mode=first.mode
            )
            names = ("weight", "scales", "biases")
        else:
            self.linear = nn.Linear(1, 1, bias=False)
            names = ("weight",)
        for name in names:
            setattr(self.linear, name, mx.concatenate([getattr(l, name) for l in linears]))
        # Made now, one layer at a time: the weights it replaces go as it does.
        mx.eval(self.linear.parameters())
        ends = mx.cumsum(mx.array([l.weight.shape[0] for l in linears])).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        # Not parameters: the last input, its outputs, and the parts that read them.
        self.last = SimpleNamespace(x=None, y=None, read=0)

    def outputs(self, x):
        last = self.last
        if last.x is not x:
            last.x, last.y, last.read = x, self.linear(x), 0
        y = last.y
        last.read += 1
        if last.read == len(self.bounds):
            last.x = last.y = None
        return y


class Part(nn.Module):
    """One of a fused projection's maps (the fused one is its owner's: its
    weights appear once in the model's parameters)."""

    def __init__(self, fused: FusedProjection, i: int):
        super().__init__()
        self.of = SimpleNamespace(fused=fused)
        self.i = i

    def __call__(self, x):
        start, end = self.of.fused.bounds[self.i]
        return self.of.fused.outputs(x)[..., start:end]


def fuse_projections(model) -> None:
    """Each layer's q/k/v (those it has) and gate/up, fused in place: the
    weights move into the fused projections, so memory stays as it was."""
    for layer in model.layers:
        for block, names in FUSED.items():
            owner = getattr(layer, block)
            present = [n for n in names if hasattr(owner, n)]
            fused = FusedProjection([getattr(owner, n) for n in present])
            setattr(owner, "_".join(n.removesuffix("_proj") for n in present) + "_fused", fused)
            for i, name in enumerate(present):
                setattr(owner, name, Part(fused, i))


def verify_logits(target, cache, taps, rows: int) -> mx.array:
    """A verify's logits (float32), its cache entries rolled back."""
    out = target(mx.array([[7] * rows], mx.uint32), cache, taps)
    mx.eval(out.logits)
    for c in cache:
        c.trim(rows)
    return out.logits.astype(mx.float32)


def mlx_target(model, drafter):
    """``model`` adapted for ``drafter`` as the engine adapts it, but left on
    MLX's own kernels (the engine routes a 4-bit target's verify rows
    through its multirow kernel on MLX-CUDA: ``multirow_qmv.py``)."""
    target = find_target_adapter(model).adapt(model)
    drafter.check_target(target)
    return target


def prefilled(scale: int, bits, rows: int, context: int):
    """The 12B-shaped target (``bits`` None: bf16) and a DSpark drafter,
    adapted (``mlx_target``), its engine caches (for verifies of ``rows``)
    holding a random ``context``-token prompt: ``(model, drafter, target, cache)``."""
    model = shapes.make_target(scale, bits=bits)
    drafter = shapes.make_drafter(scale)
    target = mlx_target(model, drafter)
    cache = target.make_cache(rows)
    prompt = mx.random.randint(5, model.args.vocab_size, (1, context)).astype(mx.uint32)
    mx.eval(target(prompt, cache, drafter.taps).logits)
    mx.eval([c.state for c in cache])
    return model, drafter, target, cache


def report(line: dict, out) -> dict:
    """``line`` as JSON to stdout, and appended to the file ``out`` if given."""
    print(json.dumps(line), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line


def verify_ms(target, cache, taps, rows: int) -> float:
    tokens = mx.array([[7] * rows], mx.uint32)

    def run():
        out = target(tokens, cache, taps)
        for c in cache:
            c.trim(rows)
        return out.logits, out.hidden

    return 1000 * seconds(run)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8, 16])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scale", type=int, default=1, choices=[1, 2, 4], help="shrink the 12B shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    bits = None if args.bits == 16 else args.bits
    model, drafter, target, cache = prefilled(args.scale, bits, max(args.rows), args.context)
    before = {rows: verify_ms(target, cache, drafter.taps, rows) for rows in args.rows}
    reference = verify_logits(target, cache, drafter.taps, max(args.rows))
    fuse_projections(model.model)
    mx.eval(model.parameters())
    after = {rows: verify_ms(target, cache, drafter.taps, rows) for rows in args.rows}
    line = {
        "bits": args.bits,
        "backend": backend(),
        "mlx": mx.__version__,
        "context": args.context,
        "verify_ms": {rows: round(before[rows], 2) for rows in args.rows},
        "fused_verify_ms": {rows: round(after[rows], 2) for rows in args.rows},
        "fused_logits_max_change": float(
            mx.abs(verify_logits(target, cache, drafter.taps, max(args.rows)) - reference).max()
        ),
    }
    return report(line, args.out)


if __name__ == "__main__":
    main()
