#!/usr/bin/env bash
# Issue 54's router table in one device call: the two anchor programs of ../shared/anchors
# (the paper's Algorithm 1 written plainly, and the router prototype) and `moremoe bench
# router`'s inference sweeps of M (h = 512 and 2,048) and k on the same GPU, then the table
# of ours against them with the targets (benchmarks/router_anchors_table.py).
#
# The anchors are not part of the repository: copy them into an ignored folder and carry it
#   mkdir -p runs/anchors && cp ../shared/anchors/*.py runs/anchors/     (carry runs/anchors)
#   OUT=/tmp/o bash benchmarks/router_anchors_gpu.sh
#   FR_BUDGET_S=200 ...   the prototype's own time budget (seconds; it skips shapes after)
#   SWEEPS=M ...          bench router's sweeps (default M,k,tune: tune times the candidates
#                         pass, config path=candidates, beside the one-pass default)
#
# Expected on one H200 (issue 54's table, before any change): ours 0.36 ms at h = 512, M =
# 512 to 2.76 at M = 16,384; the prototype 1.14-1.94x faster wherever it runs.
set -euo pipefail
ANCHORS=${ANCHORS:-runs/anchors}
OUT=${OUT:-runs/router_anchors}
SWEEPS=${SWEEPS:-M,k,tune}
export FR_BUDGET_S=${FR_BUDGET_S:-200}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
for f in paper_alg1.py fast_router.py; do
    if [ ! -f "$ANCHORS/$f" ]; then
        echo "error: $ANCHORS/$f not found; copy ../shared/anchors/*.py into $ANCHORS and carry it" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
$PY "$ANCHORS/paper_alg1.py" > "$OUT/paper_alg1.jsonl"
rm -f "$OUT/fast_router.jsonl"
OUT="$OUT" FR_SET=best $PY "$ANCHORS/fast_router.py" > /dev/null
$PY -m moremoe.cli bench router --sweeps "$SWEEPS" --no-training --no-progress \
    --out "$OUT/router.jsonl" > "$OUT/bench_router.txt"
$PY benchmarks/router_anchors_table.py "$OUT/router.jsonl" "$OUT/fast_router.jsonl" \
    | tee "$OUT/table.md"
