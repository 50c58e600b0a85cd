#!/usr/bin/env bash
# The training step's parameter-proportional work (issue 27, part 1) on one GPU: the GPU
# tests of the in-place expert gradients, the one-pass AdamW and the folded clip, then
# benchmarks/step_bench.py at MoRE-1792's and MoE-256's parameter shapes (before / after,
# CUDA events), whose table it prints beside the predictions in benchmarks/NOTES.md.
#
#   OUT=/tmp/step bash benchmarks/step_gpu.sh      # from anywhere; nothing is fetched
#
# Writes into $OUT (default benchmarks/results/step_gpu): gpu_tests.log, step.jsonl (one row
# a measurement), step.txt (the table). About 3 minutes on one H100: a minute and a half of
# tests (six short trainer runs, two of them compiled with CUDA graphs), under a minute of
# timing (MoRE-1792's fp32 weights, gradients and moments take 38 GB); the benchmark is
# stopped at 3 minutes whatever happens. Exit status: 1 if the tests or the benchmark failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/step_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
echo "== GPU tests ($(git rev-parse --short HEAD 2>/dev/null || echo no-git), $(date -u +%FT%TZ))"
# the kernel and optimizer tests run on CUDA where it exists; -m selects the unmarked too
$PY -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/training/test_step_gpu.py \
  tests/nn/test_experts_in_place_grads.py tests/kernels/test_adamw.py \
  tests/training/test_optim_clip.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
echo "== step_bench ($(date -u +%FT%TZ))"
timeout 180 $PY benchmarks/step_bench.py "$OUT/step.jsonl" | tee "$OUT/step.txt"
bench=${PIPESTATUS[0]}
echo "== done ($(date -u +%FT%TZ)): tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
