"""What the rollback cache's one-row mask costs a token's sliding-window
attention, against the unmasked attention mlx-lm's ``RotatingKVCache`` runs.

A parked round (and every plain decoding step of a speculative generation)
queries one row. mlx-lm's ``RotatingKVCache`` then holds exactly the window and
passes no mask; ``SlidingWindowKVCache`` holds ``window - 1 + rows`` slots in a
ring and masks the ``rows - 1`` stale ones. Where a backend's fused one-query
attention takes no array mask, the masked query runs another kernel. (Not
at Gemma-4's head size on MLX-CUDA 0.32.4: its one-query kernel is built for
head sizes 64, 96 and 128 only, and its cuDNN attention takes 128 at most,
so both queries run MLX's unfused attention there, the masked one with the
mask applied to its scores.) Timed at Gemma-4-12B's sliding-layer
shapes, as a chain of ``--layers`` attentions evaluated at once (a token's
sliding layers), three ways: unmasked over the window, masked over the ring
with a mask built beforehand, and the same with the mask built for the token
(as a forward builds it once for its layers). Prints JSON: milliseconds a
token and each masked way's ratio to the unmasked one.

    python benchmarks/sdpa_mask.py --context 2048
"""

import argparse
import json

import mlx.core as mx

from mlx_dspark.cache import SlidingWindowKVCache
from mlx_dspark.confidence.costs import verify_rows

from timing import backend, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--drafts", type=int, default=6, help="the drafts a round may verify")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    dtype = mx.bfloat16 if backend() != "cpu" else mx.float32
    cache = SlidingWindowKVCache(args.window, verify_rows(args.drafts))
    shape = (1, args.kv_heads, args.context, args.head_dim)
    cache.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
    ring_k, ring_v = cache.keys, cache.values
    window = (1, args.kv_heads, args.window, args.head_dim)
    window_k, window_v = (mx.random.normal(window).astype(dtype) for _ in range(2))
    query = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(dtype)
    mask = cache.make_mask(1, window_size=args.window)
    mx.eval(ring_k, ring_v, window_k, window_v, query, mask)
    scale = args.head_dim**-0.5

    def layers(keys, values, mask_for_token):
        def token():
            out, token_mask = query, mask_for_token()
            for _ in range(args.layers):
                out = mx.fast.scaled_dot_product_attention(out, keys, values, scale=scale, mask=token_mask)
            return out

        return token

    ways = {
        "unmasked window": layers(window_k, window_v, lambda: None),
        "masked ring": layers(ring_k, ring_v, lambda: mask),
        "masked ring, mask built": layers(
            ring_k, ring_v, lambda: cache.make_mask(1, window_size=args.window)
        ),
    }
    ms = {name: 1000 * seconds(fn, repeats=args.repeats, warmup=5) for name, fn in ways.items()}
    base = ms["unmasked window"]
    print(json.dumps({
        "backend": backend(),
        "mlx": mx.__version__,
        "slots": ring_k.shape[2],
        "layers": args.layers,
        "ms_per_token": {name: round(t, 3) for name, t in ms.items()},
        "x_unmasked": {name: round(t / base, 3) for name, t in ms.items()},
    }))


if __name__ == "__main__":
    main()
