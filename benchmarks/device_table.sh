#!/usr/bin/env bash
# Issue #14's paired table on a CUDA machine with MLX's CUDA build: every
# drafter (DSpark, DFlash, the Gemma-4 assistant) under the default `cost`
# scheduler, chat and math acceptance, a 4-bit and a bf16 target at context
# 2048, the bf16 target at 8192. Expects the wheels installed into ~/site as
# for device.sh; JSON lines and the rendered table (table.py) go to $OUT.
# Parts, one call each where one call's 600 s would not hold them (on an
# H100: `4bit` 240 s, `bf16` 110 s, `8192` 230 s): e.g. `bash device_table.sh 4bit`.
# At 8192 each drafter runs in a process of its own: the three drafters' caches
# together did not fit an H100's 80 GB. `probes`: the 4-bit chat rows again with
# a parked stream's probes allowed 0.01 of its time instead of the policy's 0.03
# (`paired.py --probe-share`), best run in the call after `4bit`. `kernels`:
# the 4-bit and bf16 matmuls by rows (`quantized_rows.py`) and the 4-bit
# verify with q/k/v and gate/up fused (`fused_projections.py`) and with its
# matmuls split along K (`split_k.py`): about 90 s without `split_k.py` on an
# H100, and `split_k.py`'s three 12B builds about 100 s more on an H200.
# `fresh`: the 4-bit rows with each speculative run paced as a fresh
# process's only generation (`paired.py --fresh`, as `mlx_lm.generate` runs).
# `graphcache`: `fresh` again with MLX-CUDA's CUDA graph cache at 4000 graphs,
# not 100: on an H100 a parked round right after a drafting one took 25-32 ms
# against a plain step's 11, and session 11 saw a larger cache remove the
# cost of a change of shape in a warm process. (On an H200 in session 37 it did
# not remove this one: see BENCHMARKS.md.) `nographs`: `fresh` again with CUDA
# graphs off, to tell whether they or the plain pipeline's restart make that
# round slow (bf16 rows, graphs off, paid 2-8 ms more than a plain step there).
# `multirow`: `multirow_qmv.py`, the engine's multirow kernel (on MLX-CUDA a
# 4-bit target's 2-8 verify rows by a kernel of our own) checked per shape and
# timed in the verify against MLX's (150 s on a fresh H100 in session 39,
# its first compiles included). `nomultirow`: the 4-bit rows on MLX's own kernels
# (`MLX_DSPARK_MULTIROW=0`), the baseline of the kernel's. `batch4bit`: the
# batched generator against mlx-lm's at 1, 4 and 8 sequences on the 4-bit
# target (`batch.py`, as the server drives it), with the kernel and without.
set -euo pipefail
export PYTHONPATH=~/site
export MLX_DSPARK_CACHE="${MLX_DSPARK_CACHE:-$HOME/mdc}"
cd "$(dirname "$0")"

parts=" ${*:-4bit bf16 8192} "
paired() {
    python3 paired.py --schedulers cost --taus 3.3 6 --pairs 3 --max-tokens 128 "$@"
}

if [[ $parts == *" 4bit "* ]]; then
    paired --context 2048 --target-bits 4 --drafters assistant dspark dflash \
        --out "$OUT/paired-ctx2048-4bit.jsonl"
fi
if [[ $parts == *" probes "* ]]; then
    paired --taus 3.3 --probe-share 0.01 --context 2048 --target-bits 4 --drafters assistant dspark dflash \
        --out "$OUT/paired-ctx2048-4bit-probes.jsonl"
fi
if [[ $parts == *" fresh "* ]]; then
    paired --fresh --context 2048 --target-bits 4 --drafters assistant dspark dflash \
        --out "$OUT/paired-ctx2048-4bit-fresh.jsonl"
fi
if [[ $parts == *" graphcache "* ]]; then
    MLX_CUDA_GRAPH_CACHE_SIZE=4000 paired --fresh --context 2048 --target-bits 4 \
        --drafters assistant dspark dflash --out "$OUT/paired-ctx2048-4bit-fresh-cache4000.jsonl"
fi
if [[ $parts == *" nographs "* ]]; then
    MLX_USE_CUDA_GRAPHS=0 paired --fresh --context 2048 --target-bits 4 \
        --drafters assistant dspark dflash --out "$OUT/paired-ctx2048-4bit-fresh-nographs.jsonl"
fi
if [[ $parts == *" multirow "* ]]; then
    python3 multirow_qmv.py --out "$OUT/multirow-qmv.jsonl"
fi
if [[ $parts == *" nomultirow "* ]]; then
    MLX_DSPARK_MULTIROW=0 paired --context 2048 --target-bits 4 --drafters assistant dspark dflash \
        --out "$OUT/paired-ctx2048-4bit-nomultirow.jsonl"
fi
if [[ $parts == *" batch4bit "* ]]; then
    for multirow in 1 0; do
        MLX_DSPARK_MULTIROW=$multirow python3 batch.py --drafter assistant --shapes 12b --tau 3.3 \
            --batch 1 4 8 --target-bits 4 --like-server --json "$OUT/batch-4bit-multirow$multirow.json"
    done
fi
if [[ $parts == *" bf16 "* ]]; then
    paired --context 2048 --target-bits 16 --drafters dspark assistant dflash \
        --out "$OUT/paired-ctx2048-bf16.jsonl"
fi
if [[ $parts == *" 8192 "* ]]; then
    for drafter in dspark dflash assistant; do
        paired --context 8192 --target-bits 16 --drafters "$drafter" --out "$OUT/paired-ctx8192-bf16.jsonl"
    done
fi
if [[ $parts == *" kernels "* ]]; then
    python3 quantized_rows.py --out "$OUT/quantized-rows.jsonl"
    python3 fused_projections.py --bits 4 --rows 1 2 8 16 --out "$OUT/fused-projections.jsonl"
    python3 split_k.py --rows 8 16 --splits 2 4 --out "$OUT/split-k.jsonl"
fi
if compgen -G "$OUT/paired-*.jsonl" > /dev/null; then
    python3 table.py "$OUT"/paired-*.jsonl > "$OUT/table.md"
fi
