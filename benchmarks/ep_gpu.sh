#!/usr/bin/env bash
# Expert parallelism on E GPUs (issues 26 and 38), for the machine that has them: the GPU
# tests of the expert-parallel layers (E = 2 and, with 4 GPUs, E = 4) and of the restricted
# expert kernels, then `torchrun --nproc_per_node E -m moremoe.cli bench ep`, whose table
# and targets it prints.
#
#   OUT=/tmp/ep bash benchmarks/ep_gpu.sh             # E = 2; from anywhere; nothing is fetched
#   NPROC=4 TESTS=0 OUT=/tmp/ep bash benchmarks/ep_gpu.sh   # E = 4, the benchmark alone
#
# Writes into $OUT (default benchmarks/results/ep_gpu): gpu_tests.log, ep.jsonl (the rows,
# rank 0's), ep.png and ep.txt (the printed table and targets); progress lines go to
# stderr. The benchmark's repetitions (3 warm-up calls, 10 timed; 60 rows) keep the whole
# script near 5 minutes on 2 H100s (under a minute of tests, about a minute of Triton
# compilation, two to three of timing); the benchmark is stopped at 6 minutes whatever
# happens, keeping the rows it wrote. Exit status: 1 if the tests or the benchmark failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/ep_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
NPROC=${NPROC:-2}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -lt "$NPROC" ]; then
  echo "ep_gpu.sh: error: NPROC=$NPROC needs $NPROC GPUs, this machine has $GPUS" >&2
  exit 2
fi
tests=0
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests ($(git rev-parse --short HEAD 2>/dev/null || echo no-git), $(date -u +%FT%TZ))"
  $PY -m pytest -q -m gpu -p no:cacheprovider tests/parallel/test_expert_parallel_gpu.py \
    tests/kernels/test_swiglu_experts_gpu.py -k "gpus_equal_one or shard" 2>&1 | tee "$OUT/gpu_tests.log"
  tests=${PIPESTATUS[0]}
fi
echo "== bench ep on $NPROC GPUs ($(date -u +%FT%TZ))"
rm -f "$OUT/ep.jsonl"
timeout "${BENCH_S:-360}" $PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  -m moremoe.cli bench ep --out "$OUT/ep.jsonl" ${BENCH_ARGS:-} | tee "$OUT/ep.txt"
bench=${PIPESTATUS[0]}
if [ "$bench" -ne 0 ] && [ -s "$OUT/ep.jsonl" ]; then   # cut short: the table of what landed
  $PY -c 'import sys
from moremoe.bench.ep_plots import render_ep, summary_text, table_text
from moremoe.bench.harness import read_jsonl
rows = read_jsonl(sys.argv[1])
render_ep(rows, sys.argv[2])
print(table_text(rows) + summary_text(rows))' "$OUT/ep.jsonl" "$OUT" | tee -a "$OUT/ep.txt"
fi
echo "== done ($(date -u +%FT%TZ)): tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
