#!/usr/bin/env bash
# The benchmark run on a CUDA machine with MLX's CUDA build (see BENCHMARKS.md):
# expects the mlx, mlx-cuda, mlx-lm and mlx-dspark wheels installed into ~/site
# and results to go to $OUT.
set -euo pipefail
export PYTHONPATH=~/site
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device())" >> "$OUT/gpu.txt"
python3 speculative.py --json > "$OUT/tiny.json"
python3 speculative.py --json --drafter assistant >> "$OUT/tiny.json"
python3 suite.py --out "$OUT/suite.jsonl" "$@"
python3 paired.py --out "$OUT/paired.jsonl"
python3 paired.py --target-bits 4 --out "$OUT/paired.jsonl"
