"""A 4-bit target's verify with its layers' quantized projections computed,
at 2-8 rows, by a CUDA kernel of this script's own that reads each packed
weight once for all the rows (``mx.fast.cuda_kernel``), against MLX-CUDA's.

MLX 0.32.4's CUDA backend runs 2-7 rows of an affine 4-bit matmul as one
matrix-vector product a row, each reading the whole weight again, and 8 or
more as a tiled product that leaves the GPU mostly idle at the 12B's widths:
an 8-row verify costs about 2.1x a one-row one, where bf16's costs 1.3x
(``quantized_rows.py``, ``split_k.py``). MLX 0.32 has such a kernel for Apple
silicon (``qmv_wide``, ml-explore/mlx#3764, M3 and later); this is the same
idea on CUDA. Each warp computes ``COLUMNS`` outputs for every row: it
dequantizes a packed word once and applies it to all the rows.

It checks the kernel per projection shape against a float32 reference (and
MLX's own kernel against the same) and times it against MLX's, then times
the verify (on the engine's
caches, at ``--context``) as it is and with every layer projection and the
tied output head routed through the kernel at 2-8 rows (``--columns``
outputs a warp), and how far the logits moved. JSON lines to
stdout (and ``--out``). CUDA only.

    python multirow_qmv.py --rows 1 2 4 8
"""

import argparse
import functools
import json
import zlib

import mlx.core as mx
import mlx.nn as nn

from fused_projections import prefilled, report, verify_logits, verify_ms
import quantized_rows
from quantized_rows import GROUP_SIZE, layer_shapes
from timing import backend

ROWS = range(2, 9)
COLUMNS = 4  # outputs a warp computes; the rows' inputs are read once for them
WARPS_PER_BLOCK = 4

# y[m, n] = sum_k x[m, k] * (s[n, k / G] * q[n, k] + b[n, k / G]), 8 nibbles a
# uint32 word, lowest first. A lane takes 4 words (32 weights, inside one
# group) a step; the warp's lanes cover K together and reduce at the end.
SOURCE = """
    constexpr int WORDS = K / 8;
    constexpr int GROUPS = K / G;
    constexpr int PER_LOAD = 16 / int(sizeof(T));
    const int lane = threadIdx.x & 31;
    const long first = ((long(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * C;
    if (first >= N) {
        return;
    }
    float acc[C][M];
    #pragma unroll
    for (int c = 0; c < C; ++c) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            acc[c][m] = 0.0f;
        }
    }
    for (int word = lane * 4; word < WORDS; word += 128) {
        const int k0 = word * 8;
        uint32_t packed[C][4];
        float scale[C], bias[C];
        #pragma unroll
        for (int c = 0; c < C; ++c) {
            const uint4 p = *reinterpret_cast<const uint4*>(w + (first + c) * WORDS + word);
            packed[c][0] = p.x;
            packed[c][1] = p.y;
            packed[c][2] = p.z;
            packed[c][3] = p.w;
            scale[c] = static_cast<float>(scales[(first + c) * GROUPS + k0 / G]);
            bias[c] = static_cast<float>(biases[(first + c) * GROUPS + k0 / G]);
        }
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            float xs[M][8];
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const uint4* xv = reinterpret_cast<const uint4*>(x + long(m) * K + k0 + 8 * i);
                #pragma unroll
                for (int h = 0; h < 8 / PER_LOAD; ++h) {
                    const uint4 raw = xv[h];
                    const T* t = reinterpret_cast<const T*>(&raw);
                    #pragma unroll
                    for (int j = 0; j < PER_LOAD; ++j) {
                        xs[m][h * PER_LOAD + j] = static_cast<float>(t[j]);
                    }
                }
            }
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                #pragma unroll
                for (int c = 0; c < C; ++c) {
                    const float weight = scale[c] * static_cast<float>((packed[c][i] >> (4 * j)) & 15u) + bias[c];
                    #pragma unroll
                    for (int m = 0; m < M; ++m) {
                        acc[c][m] += weight * xs[m][j];
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int c = 0; c < C; ++c) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[c][m];
            #pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                v += __shfl_down_sync(0xffffffffu, v, offset);
            }
            if (lane == 0) {
                y[long(m) * N + first + c] = static_cast<T>(v);
            }
        }
    }
"""


@functools.lru_cache(maxsize=None)
def kernel():
    # MLX keeps compiled kernels on disk by name and template values, not by
    # source: a name of the source's own, so an edited kernel is compiled anew.
    return mx.fast.cuda_kernel(
        name=f"multirow_qmv_{zlib.crc32(SOURCE.encode()):08x}",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=SOURCE,
    )


def multirow_matmul(x, w, scales, biases, group_size: int, columns: int = COLUMNS):
    """``x @ dequantize(w).T`` for the rows of ``x`` ([M, K], 4-bit affine
    ``w`` [N, K / 8]), by the kernel, ``columns`` outputs a warp."""
    rows, inputs = x.shape
    outputs = w.shape[0]
    if outputs % columns or inputs % 32 or not 1 <= rows <= 8:
        raise ValueError(f"the kernel takes 1-8 rows, inputs in 32s, outputs in {columns}s")
    return kernel()(
        inputs=[x, w, scales.astype(x.dtype), biases.astype(x.dtype)],
        template=[("T", x.dtype), ("M", rows), ("K", inputs), ("N", outputs), ("G", group_size), ("C", columns)],
        grid=(outputs // columns * 32, 1, 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(rows, outputs)],
        output_dtypes=[x.dtype],
    )[0]


def fits(linear) -> bool:
    """What the kernel computes: 4-bit affine, no bias, groups of 32-128
    (a lane's 32 weights in one group), whole 4-word steps, whole warps'
    columns."""
    return (
        isinstance(linear, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and linear.mode == "affine"
        and linear.bits == 4
        and "bias" not in linear
        and linear.group_size in (32, 64, 128)
        and linear.weight.shape[-1] % 4 == 0
        and linear.weight.shape[0] % 8 == 0
    )


def multirow_or(mlx_matmul, quantized, matmul, x):
    """``x`` times ``quantized``'s weights by ``matmul`` at ``ROWS`` rows,
    by ``mlx_matmul`` at any other count."""
    *lead, inputs = x.shape
    rows = x.size // inputs
    if rows not in ROWS:
        return mlx_matmul(x)
    q = quantized
    return matmul(x.reshape(rows, inputs), q.weight, q.scales, q.biases, q.group_size).reshape(*lead, -1)


class Multirow(nn.Module):
    """A 4-bit projection computed by ``matmul`` at ``ROWS`` rows, by MLX
    at any other count."""

    def __init__(self, linear: nn.QuantizedLinear, matmul=multirow_matmul):
        super().__init__()
        self.linear = linear
        self.matmul = matmul

    def __call__(self, x):
        return multirow_or(self.linear, self.linear, self.matmul, x)


def route_head(model, matmul=multirow_matmul) -> bool:
    """A tied 4-bit output head (``embed_tokens.as_linear``, as Gemma-4's)
    routed as the projections are (again: the last ``matmul`` wins);
    whether it was."""
    embed = model.embed_tokens
    if not fits(embed):
        return False
    mlx_matmul = type(embed).as_linear.__get__(embed)
    embed.as_linear = functools.partial(multirow_or, mlx_matmul, embed, matmul)
    return True


def route_projections(model, matmul=multirow_matmul) -> int:
    """Each layer's attention and MLP projections that ``fits``, routed
    through ``matmul`` in place (the same weights); returns how many."""
    routed = 0
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name, module in list(block.children().items()):
                if fits(module):
                    setattr(block, name, Multirow(module, matmul))
                    routed += 1
    return routed


def kernel_product(x, w, bits: int):
    """``quantized_rows.chained``'s matmul ([1, M, K] inputs) by the kernel."""
    return multirow_matmul(x[0], *w, GROUP_SIZE)[None]


def shape_report(rows, cache_mb: int, repeats: int) -> dict:
    """Per 12B projection shape and row count: the largest error of the
    kernel and of MLX's ``quantized_matmul`` against float32 (over the
    reference's largest value), and the ms a matmul of each takes, each
    waiting for the one before over weight copies beyond the cache
    (``quantized_rows.chained``: a small copy a link included); MLX's at one
    row too, the kernel's baseline."""
    by_shape = {}
    for name, (inputs, outputs) in layer_shapes().items():
        made = quantized_rows.weights(inputs, outputs, 1, 4)
        q = made[0]
        exact = mx.dequantize(*q, group_size=GROUP_SIZE, bits=4).astype(mx.float32)
        by_shape[name] = {}
        for m in rows:
            x = mx.random.normal((m, inputs)).astype(mx.bfloat16)
            reference = x.astype(mx.float32) @ exact.T
            ours = multirow_matmul(x, *q, GROUP_SIZE).astype(mx.float32)
            mlx = mx.quantized_matmul(x, *q, transpose=True, group_size=GROUP_SIZE, bits=4).astype(mx.float32)
            size = mx.abs(reference).max()
            by_shape[name][m] = {
                "kernel": round((mx.abs(ours - reference).max() / size).item(), 5),
                "mlx": round((mx.abs(mlx - reference).max() / size).item(), 5),
            }
        del exact
        copies = quantized_rows.copies_beyond(cache_mb * 2**20, sum(a.nbytes for a in q))
        made += quantized_rows.weights(inputs, outputs, copies - 1, 4)
        for m in [1] + list(rows):
            x = mx.random.normal((1, m, inputs)).astype(mx.bfloat16)
            mx.eval(x)
            products = {"mlx_ms": quantized_rows.matmul}
            if m in ROWS:
                products["kernel_ms"] = kernel_product
            entry = by_shape[name].setdefault(m, {})
            for key, product in products.items():
                chain = functools.partial(quantized_rows.chained, x, made, 4, product)
                entry[key] = round(1000 * quantized_rows.seconds(chain, repeats) / copies, 4)
        del made
        mx.clear_cache()
    return by_shape


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--check-rows", type=int, nargs="+", default=[2, 4, 8], help="rows each shape is checked and timed at")
    parser.add_argument("--cache-mb", type=int, default=60, help="the GPU's last-level cache")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--columns", type=int, nargs="+", default=[COLUMNS, 8, 2], help="outputs a warp")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--scale", type=int, default=1, choices=[1, 2, 4], help="shrink the 12B shapes")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    shapes_report = shape_report(args.check_rows, args.cache_mb, args.repeats)
    print(json.dumps({"shapes": shapes_report}), flush=True)

    model, drafter, target, cache = prefilled(args.scale, 4, max(args.rows + [8]), args.context)
    before = {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows}
    reference = verify_logits(target, cache, drafter.taps, 8)
    routed = route_projections(model.model)
    after, logits = {}, None
    for columns in args.columns:
        matmul = functools.partial(multirow_matmul, columns=columns)
        for module in model.model.modules():
            if isinstance(module, Multirow):
                module.matmul = matmul
        head = route_head(model.model, matmul)
        after[columns] = {rows: round(verify_ms(target, cache, drafter.taps, rows), 2) for rows in args.rows}
        if logits is None:
            logits = verify_logits(target, cache, drafter.taps, 8)
    line = {
        "bits": 4,
        "backend": backend(),
        "mlx": mx.__version__,
        "context": args.context,
        "projections_routed": routed,
        "head_routed": head,
        "verify_ms": before,
        "multirow_verify_ms_by_columns": after,
        "logits_max_change": float(mx.abs(logits - reference).max()),
        "logits_max": float(mx.abs(reference).max()),
        "same_argmax": float((logits.argmax(-1) == reference.argmax(-1)).astype(mx.float32).mean()),
        "shapes": shapes_report,
    }
    return report(line, args.out)


if __name__ == "__main__":
    main()
