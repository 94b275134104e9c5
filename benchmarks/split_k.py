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
from fused_projections import mlx_target, verify_logits, verify_ms
from timing import backend


class SplitK(nn.Module):
    """An affine-quantized linear map (no bias) as ``parts`` maps over
    consecutive slices of its inputs, summed. The inputs are laid out part
    by part in one copy, so that each part's matmul reads contiguous rows."""

    def __init__(self, linear: nn.QuantizedLinear, parts: int):
        super().__init__()
        self.group_size, self.bits, self.parts = linear.group_size, linear.bits, parts
        packed, groups = linear.weight.shape[-1] // parts, linear.scales.shape[-1] // parts
        self.weights = [mx.contiguous(linear.weight[:, i * packed : (i + 1) * packed]) for i in range(parts)]
        self.scales = [mx.contiguous(linear.scales[:, i * groups : (i + 1) * groups]) for i in range(parts)]
        self.biases = [mx.contiguous(linear.biases[:, i * groups : (i + 1) * groups]) for i in range(parts)]
        mx.eval(self.parameters())

    def __call__(self, x):
        *lead, k = x.shape
        xs = mx.contiguous(mx.moveaxis(x.reshape(*lead, self.parts, k // self.parts), -2, 0))
        y = None
        for x_i, w, s, b in zip(xs, self.weights, self.scales, self.biases):
            part = mx.quantized_matmul(x_i, w, s, b, transpose=True, group_size=self.group_size, bits=self.bits)
            y = part if y is None else y + part
        return y


def splittable(module, parts: int) -> bool:
    """An affine-quantized map without a bias, of 2, 4 or 8 bits (whole
    values to a packed word), whose groups divide into ``parts``."""
    return (
        isinstance(module, nn.QuantizedLinear)
        and module.mode == "affine"
        and 32 % module.bits == 0
        and "bias" not in module
        and module.scales.shape[-1] % parts == 0
    )


def split_projections(model, parts: int) -> int:
    """Each layer's attention and MLP projections that split into ``parts``
    (``splittable``), split in place; returns how many were."""
    split = 0
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, module in list(block.children().items()):
                if splittable(module, parts):
                    setattr(block, name, SplitK(module, parts))
                    split += 1
    return split


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scale", type=int, default=1, choices=[1, 2, 4], help="shrink the 12B shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    drafter = shapes.make_drafter(args.scale)
    vocab = shapes.target_config(args.scale)["vocab_size"]
    prompt = mx.random.randint(5, vocab, (1, args.context), key=mx.random.key(1)).astype(mx.uint32)
    lines = []
    for parts in [1] + args.splits:
        mx.random.seed(0)  # the same weights, split or not
        model = shapes.make_target(args.scale, bits=4)
        split = split_projections(model.model, parts) if parts > 1 else 0
        target = mlx_target(model, drafter)
        cache = target.make_cache(max(args.rows))
        mx.eval(target(prompt, cache, drafter.taps).logits)
        logits = verify_logits(target, cache, drafter.taps, max(args.rows))
        line = {
            "bits": 4,
            "splits": parts,
            "projections_split": split,
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
