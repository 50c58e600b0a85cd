#!/usr/bin/env bash
# The decode work of issue 28 on one GPU, under 4 minutes on an H100:
#   1. the GPU tests of the static cache and the captured step (tests/model/test_static_gpu.py)
#      and of transformers' compiled static-cache generate (tests/hf/test_hf_gpu.py);
#   2. `moremoe bench model`'s decode rows of the three h = 512 pairs at B = 1, 8, 64:
#      compiled (torch.compile'd step, captured) and captured (the step's own kernels,
#      captured) with 64 new tokens, then eager (the Python loop) with 16, each row against
#      the step's byte floor, and MoRE / MoE per mode and batch.
#
#   OUT=/tmp/decode bash benchmarks/decode_gpu.sh        # from anywhere; nothing is fetched
#
# Writes $OUT/gpu_tests_decode.log, $OUT/model.jsonl (the rows: copy them into
# benchmarks/results/<device>/model.jsonl to commit), $OUT/model.png, $OUT/model_decode.png
# and $OUT/model_table.txt. Each part runs under its own bound and the whole within
# $BUDGET_S seconds (default 235); PAIRS, MODES and BATCHES override the bench's sets.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/decode_gpu}
PAIRS=${PAIRS:-h512-s64,h512-s128,h512-s64-x8}
MODES=${MODES:-compiled,captured}
BATCHES=${BATCHES:-1,8,64}
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${BUDGET_S:-235}))
mkdir -p "$OUT"
cd "$ROOT" || exit 2

left() {   # left BOUND: the seconds a part may take, within the whole budget
  local rest=$((DEADLINE - SECONDS))
  echo $(( $1 < rest ? $1 : (rest > 5 ? rest : 5) ))
}

echo "== GPU tests (bound $(left 90) s)"
timeout "$(left 90)" $PY -m pytest -q -m gpu -p no:cacheprovider \
    tests/model/test_static_gpu.py tests/hf/test_hf_gpu.py 2>&1 | tee "$OUT/gpu_tests_decode.log"
tests_rc=${PIPESTATUS[0]}

bench() {   # bench BOUND ARGS...: one `moremoe bench model` run appending to $OUT/model.jsonl
  local bound
  bound=$(left "$1"); shift
  echo "== bench model $* (bound $bound s)"
  timeout "$bound" $PY -m moremoe.cli bench model --phases decode --pairs "$PAIRS" \
      --batches "$BATCHES" --out "$OUT/model.jsonl" "$@" | tee -a "$OUT/model_table.txt"
  return "${PIPESTATUS[0]}"
}
bench 110 --decode-modes "$MODES" --new-tokens 64
static_rc=$?
bench 60 --decode-modes eager --new-tokens 16
eager_rc=$?

echo "== done in ${SECONDS} s: tests rc=$tests_rc, bench rc=$static_rc (static), $eager_rc (eager)"
echo "   rows: $OUT/model.jsonl; tests: $OUT/gpu_tests_decode.log"
[ "$tests_rc" = 0 ] && [ "$static_rc" = 0 ] && [ "$eager_rc" = 0 ]
