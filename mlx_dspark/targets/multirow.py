"""A quantized target's verify on MLX-CUDA: 2-8 rows of a 4-bit projection
by a kernel that reads each packed weight once for all the rows.

MLX 0.32's CUDA backend runs 2-7 rows of an affine 4-bit matmul as one
matrix-vector product a row, each reading the whole weight again, and 8 or
more as a tiled product that leaves the GPU mostly idle at a 12B's widths:
on an H100 a Gemma-4-12B 4-bit verify of 2, 4 and 8 rows took 22.6, 36.1 and
28.4 ms against one row's 13.6; with this kernel at every row count 16.4,
18.3 and 21.4, and issue #14's 4-bit chat rows went from 0.98-1.07x of
plain decoding to 1.33-1.40x (BENCHMARKS.md, "Session 39"). MLX has the same idea
for Apple silicon (``qmv_wide``, M3 and later), so only CUDA needs it.

``route`` gives a model's fitting projections (and a tied 4-bit output
head) a subclass of MLX's own module that runs the kernel only inside
``verifying()``, which the target adapters' forwards enter (verifies, and
the engine's prompt chunks), and only at 2-8 rows: plain decoding's one row,
long prompt chunks and anything mlx-lm runs itself (its batched decoding
too) stay on MLX's kernels. ``choose`` then keeps the kernel, shape by shape,
only at the row counts where this machine measured it faster than MLX's
(on an H100, MLX's tiled kernel was faster at 8 rows for the 12B's widest
projections and its head). ``MLX_DSPARK_MULTIROW=0`` turns it off.
"""

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..confidence import costs
from ..confidence.calibration import user_cache_dir

ROWS = range(2, 9)
COLUMNS = 4  # outputs a warp computes (2 and 8 were slower at 8 rows on an H100)
WARPS_PER_BLOCK = 4

# y[m, n] = sum_k x[m, k] * (s[n, k / G] * q[n, k] + b[n, k / G]), 8 nibbles a
# uint32 word, lowest first. A lane takes 4 words (32 weights, inside one
# group) a step; the warp's lanes cover K together and reduce at the end.
SOURCE = """
    const int WORDS = K / 8;
    const int GROUPS = K / G;
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
                const uint4* xv = reinterpret_cast<const uint4*>(x + m * K + k0 + 8 * i);
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


_verifying = contextvars.ContextVar("mlx_dspark_multirow_verifying", default=False)


@contextlib.contextmanager
def verifying():
    """Routed projections run the kernel inside this (at ``ROWS`` rows)."""
    token = _verifying.set(True)
    try:
        yield
    finally:
        _verifying.reset(token)


# The widths are template constants, so MLX compiles the kernel once per
# dtype, row count and projection shape (63 compiles for a 12B, 1.4-3.5 s
# each on an H100). Read from the inputs' shapes instead it compiled 7, but
# verified 2-4 rows 0.2-0.9 ms slower (BENCHMARKS.md, session 39); MLX keeps
# compiled kernels on disk, so only a machine's first generation waits.
@functools.cache
def kernel():
    # MLX keeps compiled kernels on disk by name and template values, not by
    # source: a name of the source's own, so an edited kernel is compiled anew.
    return mx.fast.cuda_kernel(
        name=f"multirow_qmv_{zlib.crc32(SOURCE.encode()):08x}",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=SOURCE,
    )


def multirow_matmul(x, w, scales, biases, group_size: int):
    """``x @ dequantize(w).T`` for the rows of ``x`` ([M, K], 4-bit affine
    ``w`` [N, K / 8]), by the kernel."""
    rows, inputs = x.shape
    outputs = w.shape[0]
    return kernel()(
        inputs=[x, w, scales.astype(x.dtype), biases.astype(x.dtype)],
        template=[("T", x.dtype), ("M", rows), ("K", inputs), ("N", outputs), ("G", group_size), ("C", COLUMNS)],
        grid=(outputs // COLUMNS * 32, 1, 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(rows, outputs)],
        output_dtypes=[x.dtype],
    )[0]


def fits(module) -> bool:
    """What the kernel computes: 4-bit affine, no bias, groups of 32-128
    (a lane's 32 weights in one group), whole 4-word steps, whole warps'
    columns."""
    return (
        isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and module.mode == "affine"
        and module.bits == 4
        and "bias" not in module
        and module.group_size in (32, 64, 128)
        and module.weight.shape[-1] % 4 == 0
        and module.weight.shape[0] % COLUMNS == 0
    )


def _by_kernel(module, x):
    """``x`` times ``module``'s weights by the kernel, or ``None`` where
    MLX's own kernels take it: outside a target's forward, at rows the
    kernel was not chosen for (2-8 at most), or
    inputs MLX would promote or refuse (another dtype than the scales',
    another width than the weights')."""
    if not _verifying.get():
        return None
    rows = x.size // x.shape[-1]
    if rows not in module.kernel_rows or x.dtype != module.scales.dtype or x.shape[-1] != module.weight.shape[-1] * 8:
        return None
    flat = x.reshape(rows, x.shape[-1])
    y = multirow_matmul(flat, module.weight, module.scales, module.biases, module.group_size)
    return y.reshape(*x.shape[:-1], -1)


class MultirowQuantizedLinear(nn.QuantizedLinear):
    kernel_rows = frozenset(ROWS)  # ``choose`` narrows it per shape

    def __call__(self, x):
        y = _by_kernel(self, x)
        return super().__call__(x) if y is None else y


class MultirowQuantizedEmbedding(nn.QuantizedEmbedding):
    kernel_rows = frozenset(ROWS)

    def as_linear(self, x):
        y = _by_kernel(self, x)
        return super().as_linear(x) if y is None else y


ROUTED = {nn.QuantizedLinear: MultirowQuantizedLinear, nn.QuantizedEmbedding: MultirowQuantizedEmbedding}


def available() -> bool:
    """Whether routing applies here: MLX-CUDA on the GPU, not turned off."""
    return (
        os.environ.get("MLX_DSPARK_MULTIROW", "1") != "0"
        and hasattr(mx.fast, "cuda_kernel")
        and mx.cuda.is_available()
        and mx.default_device() == mx.gpu
    )


def works() -> str:
    """Why the kernel cannot be used here ("" where it can): it has to
    compile (NVRTC, at run time) and compute a small product as MLX does.
    MLX keeps the compiled kernel on disk, so this costs a compile once a
    machine."""
    # bf16, as 4-bit checkpoints run (and as the kernel was timed on a GPU).
    # A product computed in another order differs from MLX's by a few bf16
    # roundings (on an H100, 0.2-0.7% of the largest output); a wrong one
    # by about the outputs themselves.
    weights = mx.random.normal((2 * COLUMNS, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    quantized = mx.quantize(weights, group_size=32, bits=4)
    x = mx.random.normal((2, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    try:
        ours = multirow_matmul(x, *quantized, 32)
        theirs = mx.quantized_matmul(x, *quantized, transpose=True, group_size=32, bits=4)
        same = (mx.abs(ours - theirs).max() <= 2**-4 * mx.abs(theirs).max()).item()
    except RuntimeError as e:
        return f"it did not compile or run ({e})"
    return "" if same else "it computed another product than MLX's"


def route(model: nn.Module) -> int:
    """Gives each of ``model``'s modules that ``fits`` the kernel's
    subclass in place (same weights, same parameter tree); returns how many
    of its modules are routed."""
    for _, module in model.named_modules():
        routed = ROUTED.get(type(module))
        if routed is not None and fits(module):
            module.__class__ = routed
    return routed_count(model)


def unroute(model: nn.Module) -> None:
    """``model``'s routed modules back to MLX's own classes (routing turned
    off, or the default device no longer MLX-CUDA's GPU, since routing)."""
    for module in _routed(model):
        _to_mlx(module)
    model.__dict__.pop("multirow_considered", None)


def considered(model: nn.Module) -> bool:
    """Whether routing ``model`` was tried in this process (whatever came of
    it: a kernel that failed its check, or timed slower everywhere, is not
    tried again each generation), since ``unroute``."""
    return model.__dict__.get("multirow_considered", False)


def consider(model: nn.Module) -> None:
    model.multirow_considered = True


def _to_mlx(module) -> None:
    module.__class__ = {routed: own for own, routed in ROUTED.items()}[type(module)]
    module.__dict__.pop("kernel_rows", None)  # routed again, it starts from every row


def _routed(model: nn.Module) -> list:
    return [m for _, m in model.named_modules() if type(m) in ROUTED.values()]


def routed_count(model: nn.Module) -> int:
    return len(_routed(model))


def routing(model: nn.Module) -> list:
    """The routed modules' shapes, each with its rows by the kernel: what a
    routed target's verify costs depend on."""
    return sorted({(shape_key(m), tuple(sorted(m.kernel_rows))) for m in _routed(model)})


def shape_key(module) -> str:
    """What the kernel's speed against MLX's depends on: the product's
    widths, its groups and the activations' dtype (the scales')."""
    return f"{module.weight.shape[0]}x{module.weight.shape[1] * 8}/{module.group_size} {module.scales.dtype}"


def kernel_faster(modules, rows: int, clock=None) -> bool:
    """Whether the kernel computed ``rows`` random rows by each of
    ``modules`` (one shape; all of them, so that the weights come from
    memory as in a verify, not from the cache) faster than MLX's kernels."""
    first = modules[0]
    x = mx.random.normal((rows, first.weight.shape[1] * 8), key=mx.random.key(0)).astype(first.scales.dtype)

    def chained(product):
        # Each product waits for the one before, as a forward's do: MLX-CUDA
        # runs independent kernels side by side, which hid what its tiled
        # kernel costs at 8 rows (an H100 chose it for every 12B shape).
        # ``mx.depends`` would launch nothing to wait for.
        def run():
            inputs = x
            for m in modules:
                y = product(inputs, m)
                inputs = x + 0 * y[:, :1]
            return inputs
        return run

    def by_kernel(inputs, m):
        return multirow_matmul(inputs, m.weight, m.scales, m.biases, m.group_size)

    def by_mlx(inputs, m):
        return mx.quantized_matmul(
            inputs, m.weight, m.scales, m.biases, transpose=True, group_size=m.group_size, bits=4
        )

    kernel, mlx = costs.fastest_seconds(chained(by_kernel), chained(by_mlx), clock=clock)
    return kernel < mlx


def choose(model: nn.Module) -> int:
    """Keeps each routed module's kernel only at the rows where it was
    measured faster than MLX's for its shape on this machine; a module that
    it was faster for at no rows goes back to MLX's class. A shape is
    measured once a machine (its choice kept in the cache folder: the first
    measurement compiles the kernel for each row count). Returns how many
    of ``model``'s modules stay routed."""
    by_shape = {}
    for module in _routed(model):
        by_shape.setdefault(shape_key(module), []).append(module)
    path = choices_path()
    known = _read_choices(path)
    missing = [shape for shape in by_shape if shape not in known]
    if missing:
        print(
            f"mlx-dspark: timing the multirow kernel against MLX's at {len(missing)} "
            "projection shapes and 2-8 rows, once a machine (the first time, minutes "
            "for a 12B: it compiles the kernel for each).",
            file=sys.stderr,
        )
        for shape in missing:
            known[shape] = [rows for rows in ROWS if _timed_faster(by_shape[shape], rows)]
        _save_choices(path, {shape: known[shape] for shape in missing})
    for shape, modules in by_shape.items():
        rows = frozenset(known[shape])
        for module in modules:
            if rows:
                module.kernel_rows = rows
            else:
                _to_mlx(module)
    return routed_count(model)


def _timed_faster(modules, rows: int) -> bool:
    """``kernel_faster``, where a kernel that does not compile or run at
    this shape and row count (``works`` tried one small product) is not."""
    try:
        return kernel_faster(modules, rows)
    except RuntimeError as e:
        print(f"mlx-dspark: the multirow kernel is not used at {shape_key(modules[0])}, {rows} rows: {e}", file=sys.stderr)
        return False


# How ``kernel_faster`` times: part of the choices' key, so that a change of
# it times every shape again.
TIMING = "chained products, fastest of costs.REPEATS passes"


def choices_path() -> Path:
    """This machine's choices: its device, MLX, its launch settings, the
    kernel's source and how it was timed."""
    identity = {
        "device": costs.device_identity(),
        "mlx": mx.__version__,
        "settings": {name: os.environ[name] for name in costs.LAUNCH_SETTINGS if name in os.environ},
        "kernel": [SOURCE, COLUMNS, WARPS_PER_BLOCK],
        "timing": [TIMING, costs.REPEATS],
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return user_cache_dir() / "multirow" / f"{key}.json"


def _read_choices(path: Path) -> dict:
    """The shapes' rows by the kernel, those well formed (a file that
    cannot be read is measured again)."""
    try:
        choices = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(choices, dict):
        return {}
    return {
        shape: rows for shape, rows in choices.items()
        if isinstance(rows, list) and all(isinstance(r, int) and r in ROWS for r in rows)
    }


def _save_choices(path: Path, choices: dict) -> None:
    """Adds ``choices`` to the file, whole or not at all (another process
    may write it too: it loses at most a measurement, taken again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({**_read_choices(path), **choices}, indent=1, sort_keys=True))
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache costs a measurement next time
