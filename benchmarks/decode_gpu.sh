#!/usr/bin/env bash
# The decode work of issue 28 on one GPU, under 4 minutes on an H100:
#   1. the GPU tests of the static cache and the captured step (tests/model/test_static_gpu.py),
#      of `moremoe generate` on the GPU (tests/test_cli_generate_device.py) and of
#      transformers' compiled static-cache generate (tests/hf/test_hf_gpu.py);
#   2. `moremoe bench model`'s decode rows of the h = 512 pairs at B = 1, 8, 64, each against
#      the step's byte floor, and MoRE / MoE per mode and batch, cheapest mode first so every
#      pair gets its rows before the bound cuts a slower mode: captured (the step's own
#      kernels, one CUDA-graph replay a step; no compilation), then compiled (the blocks and
#      the head torch.compile'd, then captured: tens of seconds of inductor a model), both
#      with 64 new tokens, then eager (the Python loop) with 16.
#
#   OUT=/tmp/decode bash benchmarks/decode_gpu.sh        # from anywhere; nothing is fetched
#   OUT=/tmp/decode TESTS=0 PAIRS=h512-s64-x8 MODES=compiled bash benchmarks/decode_gpu.sh
#
# Each part runs under its own bound (timeout, killed 5 s after) and the whole within
# $BUDGET_S seconds (default 230): a part the budget cuts keeps the rows it measured (the
# bench appends each row as it comes; `moremoe bench model --plot-only $OUT/model.jsonl`
# then renders the plots and the table the cut run did not). Should the compiled rows of all three pairs not fit,
# the second form above measures the missing ones, a pair a run (each under 4 minutes).
# PAIRS, MODES (default captured,compiled) and BATCHES override the bench's sets; TESTS=0
# skips the tests. Writes $OUT/gpu_tests_decode.log, $OUT/model.jsonl (the rows: copy them
# into benchmarks/results/<device>/model.jsonl to commit), $OUT/model.png,
# $OUT/model_decode.png and $OUT/model_table.txt.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/decode_gpu}
PAIRS=${PAIRS:-h512-s64,h512-s128,h512-s64-x8}
MODES=${MODES:-captured,compiled}
BATCHES=${BATCHES:-1,8,64}
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${BUDGET_S:-230}))
mkdir -p "$OUT"
cd "$ROOT" || exit 2

left() {   # left BOUND: the seconds a part may take within the whole budget (0: none left)
  local rest=$((DEADLINE - SECONDS))
  rest=$(( rest > 0 ? rest : 0 ))
  echo $(( $1 < rest ? $1 : rest ))
}

bounded() {   # bounded BOUND CMD...: CMD under the bound; 124 when no time was left for it
  local bound
  bound=$(left "$1"); shift
  [ "$bound" -gt 0 ] || { echo "   (no time left in the budget: skipped)"; return 124; }
  timeout -k 5 "$bound" "$@"
}

tests_rc=skipped
if [ "${TESTS:-1}" != 0 ]; then
  echo "== GPU tests (bound $(left 75) s)"
  bounded 75 $PY -m pytest -q -m gpu -p no:cacheprovider tests/model/test_static_gpu.py \
      tests/test_cli_generate_device.py tests/hf/test_hf_gpu.py 2>&1 \
      | tee "$OUT/gpu_tests_decode.log"
  tests_rc=${PIPESTATUS[0]}
fi

bench() {   # bench BOUND MODE NEW_TOKENS: one `moremoe bench model` run into $OUT/model.jsonl
  local args=(bench model --phases decode --pairs "$PAIRS" --batches "$BATCHES"
              --out "$OUT/model.jsonl" --decode-modes "$2" --new-tokens "$3")
  echo "== ${args[*]} (bound $(left "$1") s)"
  bounded "$1" $PY -m moremoe.cli "${args[@]}" | tee -a "$OUT/model_table.txt"
  return "${PIPESTATUS[0]}"
}
rcs=""
for mode in ${MODES//,/ }; do
  bench 85 "$mode" 64
  rcs="$rcs $mode=$?"
done
bench 60 eager 16
rcs="$rcs eager=$?"

echo "== done in ${SECONDS} s: tests rc=$tests_rc, bench rc:$rcs (124: cut by its bound)"
echo "   rows: $OUT/model.jsonl; tests: $OUT/gpu_tests_decode.log"
[ "$tests_rc" = 0 ] || [ "$tests_rc" = skipped ] || exit 1
case "$rcs" in *=[1-9]*) exit 1 ;; esac
