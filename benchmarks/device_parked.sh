#!/usr/bin/env bash
# Where a paced stream's time goes on a CUDA machine (issue #14: the 4-bit
# target with the Gemma-4 assistant at chat acceptance, and the batched
# assistant's `cost` policy against `fixed`). Expects the wheels installed into
# ~/site as for device.sh; results go to $OUT (the batch policy's switches in
# batch-assistant.log, a single stream's in paired-4bit-assistant.log; the
# time each kind of round lost against plain decoding, parked rounds and
# probes apart, in the paired JSON lines; the cost profiles measured in
# verify-cost/). About 8 minutes on an H200 for `single` and `batch`.
set -euo pipefail
export PYTHONPATH=~/site
export MLX_DSPARK_CACHE="${MLX_DSPARK_CACHE:-$HOME/mdc}"
cd "$(dirname "$0")"

debug() {  # run a benchmark with the policies' debug lines on stderr
    python3 -c "import logging, runpy, sys; logging.basicConfig(level=logging.DEBUG, format='%(asctime)s %(message)s'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" "$@"
}

# Parts to run (all by default), one call each where one call's 600 s would not
# hold them all: `single` (the 4-bit assistant's stream), `batch` (the batched
# assistant) and `trace` (the batched assistant's `cost` choices round by round
# against `fixed`'s, with each kind of round's predicted and real time, and the
# generator's slow steps in its log: what a run spent outside its rounds), e.g.
# `bash device_parked.sh single`.
parts=" ${*:-single batch trace} "

if [[ $parts == *" single "* ]]; then
    python3 parked.py --target-bits 4 --drafter assistant --context 2048 --passes 3 \
        --out "$OUT/parked-4bit-assistant.jsonl"
    debug paired.py --context 2048 --target-bits 4 --drafters assistant --taus 3.3 --schedulers cost fixed \
        --pairs 3 --max-tokens 128 --out "$OUT/paired-4bit-assistant.jsonl" \
        2> "$OUT/paired-4bit-assistant.log"
fi
if [[ $parts == *" batch "* ]]; then
    MLX_USE_CUDA_GRAPHS=0 debug batch.py --drafter assistant --shapes 12b --tau 3.3 --batch 1 4 8 \
        --like-server --json "$OUT/batch-assistant.json" 2> "$OUT/batch-assistant.log"
fi
if [[ $parts == *" trace "* ]]; then
    MLX_USE_CUDA_GRAPHS=0 debug policy_trace.py --shapes 12b --drafter assistant --tau 3.3 \
        --batch 1 4 8 --max-tokens 64 --rounds --json "$OUT/policy-trace-assistant.json" \
        > "$OUT/policy-trace-assistant.txt" 2> "$OUT/policy-trace-assistant.log"
fi
mkdir -p "$OUT/verify-cost"
find "$MLX_DSPARK_CACHE/verify-cost" -name '*.json' -exec cp {} "$OUT/verify-cost/" \; 2> /dev/null || true
