#!/usr/bin/env bash
# Issue 33 on one GPU: the phonebook step's GPU tests, `moremoe bench phonebook` (eager, one
# CUDA graph, compiled then captured; the trainer's loop; 1-8 runs on streams, 2 and 4
# processes), the demo's time, and a short `phonebook reproduce` that checks the executor's
# path end to end (stopped by --stop-after, then resumed for a minute).
#
#   OUT=/tmp/pbgpu bash benchmarks/phonebook_gpu.sh      # from anywhere; nothing is fetched
#
# Writes into $OUT: gpu_tests.log, phonebook.jsonl (bench rows), bench.txt, demo.txt,
# reproduce.txt. Each part is bounded (LIMIT_TESTS, LIMIT_BENCH, LIMIT_DEMO, LIMIT_REPRO
# seconds); about 8 minutes on one H100. Exit status 1 if a part failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/phonebook_gpu}
MODES=${MODES:-eager,graph,compiled}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
cd "$ROOT"
status=0
part() {   # part NAME LIMIT_S LOG COMMAND...: run bounded, log it, remember a failure
  local name=$1 limit=$2 log=$3; shift 3
  echo "== $name ($MOREMOE_COMMIT, $(date -u +%FT%TZ), limit ${limit}s)" | tee -a "$log"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc ($(date -u +%FT%TZ))" | tee -a "$log"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 75 ] || status=1     # 75: stopped by --stop-after
}
part "GPU tests" "${LIMIT_TESTS:-200}" "$OUT/gpu_tests.log" \
  $PY -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/phonebook/test_phonebook_gpu.py \
  tests/phonebook/test_step.py
part "bench phonebook" "${LIMIT_BENCH:-270}" "$OUT/bench.txt" \
  $PY -m moremoe.cli bench phonebook --modes "$MODES" --out "$OUT/phonebook.jsonl"
part "demo" "${LIMIT_DEMO:-90}" "$OUT/demo.txt" \
  $PY -m moremoe.cli demo --out /tmp/pb-demo --force
rm -rf /tmp/pb-repro
part "reproduce, stopped" "${LIMIT_REPRO:-90}" "$OUT/reproduce.txt" \
  $PY -m moremoe.cli phonebook reproduce --points h64-s8 --out /tmp/pb-repro --stop-after 0.75
part "reproduce, resumed" "${LIMIT_REPRO:-90}" "$OUT/reproduce.txt" \
  $PY -m moremoe.cli phonebook reproduce --points h64-s8 --out /tmp/pb-repro --resume \
  --stop-after 0.75
exit $status
