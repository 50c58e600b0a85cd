#!/usr/bin/env bash
# Issue 54 part 1's profile in one device call: benchmarks/router_profile.py's variants of
# the one pass and the prototype timed and profiled by kernel (torch.profiler), then the
# one-pass kernel, the exact sweep of its queue and the prototype's kernel under Nsight
# Compute (one call each, after warm-up; the sections that say whether a kernel waits on
# memory, on its issue slots or on latency, and how many warps it keeps).
#
#   mkdir -p runs/anchors && cp ../shared/anchors/*.py runs/anchors/     (carry runs/anchors)
#   OUT=/tmp/o bash benchmarks/router_ncu.sh
#   SHAPES=512:512:4,512:8192:4 ...   h:M:k list (default these two and k = 1 at M = 8,192)
#   NCU=0 ...                          the timings only
#
# ncu reads the hardware counters on the Firecracker machines, with the clocks left alone
# (--clock-control none: the device's METHOD.md); where it cannot, its error is in
# $OUT/ncu.err and the timings stand alone.
set -euo pipefail
OUT=${OUT:-runs/router_ncu}
ANCHORS=${ANCHORS:-runs/anchors}
SHAPES=${SHAPES:-512:512:4,512:8192:4,512:8192:1}
NCU=${NCU:-1}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
$PY benchmarks/router_profile.py --anchors "$ANCHORS" --shapes "$SHAPES" "$OUT/router_profile.jsonl"
if [ "$NCU" = 1 ]; then
    rc=0
    ncu --profile-from-start off --clock-control none --target-processes all \
        -k 'regex:_buffer_kernel|_exact_kernel|router_topcf' \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --csv --page details \
        $PY benchmarks/router_profile.py --anchors "$ANCHORS" --shapes "$SHAPES" --ncu \
        > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || rc=$?
    echo "router_ncu.sh: ncu exited $rc ($(wc -l < "$OUT/ncu.csv") lines in ncu.csv)"
fi
