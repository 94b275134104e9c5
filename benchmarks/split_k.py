"""A 4-bit target's verify by rows with each layer's quantized matmuls split
along their inputs (K) into ``--splits`` matmuls whose outputs are summed.

On an H100 a 4-bit verify of 8 rows cost about twice one of a row, and
fusing q/k/v and gate/up did not change it (``fused_projections.py``); the
same matmuls cost no more at 8 rows than at one when others ran beside them.
MLX-CUDA's Hopper kernel does badly at small N and K (ml-explore/mlx#3160),
and the 12B's k, v, o and down projections have N of 2048-3840. Split along
K, the parts are independent kernels that can run side by side. This times
the verify (on the engine's caches, at ``--context``) as it is and split,
and how far the logits moved. JSON lines to stdout (and ``--out``).

    python split_k.py --rows 8 16 --splits 2 4
"""

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

import shapes
from fused_projections import verify_ms
from mlx_dspark.speculative.engine import adapt_target
from timing import backend


class SplitK(nn.Module):
    """A quantized linear map (no bias) as ``parts`` maps over consecutive
    slices of its inputs, summed."""

    def __init__(self, linear: nn.QuantizedLinear, parts: int):
        super().__init__()
        self.group_size, self.bits, self.mode = linear.group_size, linear.bits, linear.mode
        k = linear.scales.shape[-1] * linear.group_size
        self.inputs = [(i * k // parts, (i + 1) * k // parts) for i in range(parts)]
        packed = 32 // linear.bits
        self.weights = [mx.contiguous(linear.weight[:, a // packed : b // packed]) for a, b in self.inputs]
        groups = [(a // linear.group_size, b // linear.group_size) for a, b in self.inputs]
        self.scales = [mx.contiguous(linear.scales[:, a:b]) for a, b in groups]
        self.biases = [mx.contiguous(linear.biases[:, a:b]) for a, b in groups]
        mx.eval(self.parameters())

    def __call__(self, x):
        return sum(
            mx.quantized_matmul(
                x[..., a:b], w, s, bi, transpose=True, group_size=self.group_size, bits=self.bits, mode=self.mode
            )
            for (a, b), w, s, bi in zip(self.inputs, self.weights, self.scales, self.biases)
        )


def split_projections(model, parts: int) -> None:
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, module in list(block.children().items()):
                groups = module.scales.shape[-1] if isinstance(module, nn.QuantizedLinear) else 0
                if groups and groups % parts == 0 and "bias" not in module:
                    setattr(block, name, SplitK(module, parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scale", type=int, default=1, choices=[1, 2, 4], help="shrink the 12B shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    drafter = shapes.make_drafter(args.scale)
    prompt = None
    lines = []
    for parts in [1] + args.splits:
        mx.random.seed(0)
        model = shapes.make_target(args.scale, bits=4)
        if parts > 1:
            split_projections(model.model, parts)
        target = adapt_target(model, drafter)
        cache = target.make_cache(max(args.rows))
        if prompt is None:
            prompt = mx.random.randint(5, model.args.vocab_size, (1, args.context)).astype(mx.uint32)
        mx.eval(target(prompt, cache, drafter.taps).logits)
        out = target(mx.array([[7] * max(args.rows)], mx.uint32), cache, drafter.taps)
        logits = out.logits.astype(mx.float32)
        mx.eval(logits)
        for c in cache:
            c.trim(max(args.rows))
        line = {
            "bits": 4,
            "splits": parts,
            "backend": backend(),
            "mlx": mx.__version__,
            "context": args.context,
            "verify_ms": {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows},
        }
        if parts == 1:
            reference = logits
        else:
            # A random 48-layer target amplifies rounding: read it against the logits' own size.
            line["logits_max_change"] = float(mx.abs(logits - reference).max())
            line["logits_max"] = float(mx.abs(reference).max())
        print(json.dumps(line), flush=True)
        lines.append(line)
        del model, target, cache
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return lines


if __name__ == "__main__":
    main()
