#!/usr/bin/env bash
# Issue 54's measurements in device calls: each item writes its rows, tables and logs under
# $OUT as it measures (a device call's copy of benchmarks/results is the local file again at
# the next call's start, so rows written there are lost). Pick the items a call has time
# for; each prints its wall time. Where a call leaves more than 8 files under $OUT (what a
# device call returns), they are packed into $OUT/results.tgz (benchmarks/pack_out.sh):
# `tar xzf` it where the call's files land.
#
#   mkdir -p runs/anchors && cp ../shared/anchors/*.py runs/anchors/       (carry runs/anchors)
#   ITEMS=tests OUT=$OUT bash benchmarks/issue54_gpu.sh                     # ~9 min alone
#   ITEMS=router OUT=$OUT bash benchmarks/issue54_gpu.sh                    # ~6 min
#   ITEMS=experts,phonebook OUT=$OUT bash benchmarks/issue54_gpu.sh         # ~5 min
#   ITEMS=pair OUT=$OUT bash benchmarks/issue54_gpu.sh                      # ~6 min
#
# Items:
#   tests      make test-gpu-kernels (every kernel test, compiled for the GPU) -> tests.log
#   suite      every single-GPU test in one call (~5 min fresh, GPU_JOBS=8): make
#              test-gpu-kernels -> gpu_kernels.log, then make test-gpu outside tests/kernels
#              -> gpu_other.log (its gpu_serial part run even where the parallel part failed)
#   router     the anchors' table (benchmarks/router_anchors_gpu.sh, SWEEPS=M,k) -> router/,
#              then router_profile.py's PROFILE_VARIANTS at PROFILE_SHAPES (h:M:k, default
#              M = 512, 2,048, 8,192 at k 4 and M = 8,192 at k 8) -> router/profile.jsonl
#   experts    bench experts at the presets', the phonebook's and the study's shapes
#   tune       bench experts --tune
#   phonebook  bench phonebook, the compiled step (kernels a step and the most launched)
#   meta       benchmarks/routing_meta_ab.py (the routing metadata's three paths)
#   pair       benchmarks/train_pair.sh, MINUTES=1.3 (the training step's ratios, part 4)
#   inductor   benchmarks/phonebook_inductor_ab.py: the compiled phonebook step with inductor's
#              options (INDUCTOR_VARIANTS, default combo,combo_mm: the step's default and the
#              GEMMs autotuned too; ms and kernels a step, MoE-32 and MoRE-96; ~3 min or more)
set -euo pipefail
ITEMS=${ITEMS:-router,experts,phonebook}
OUT=${OUT:-runs/issue54}
ANCHORS=${ANCHORS:-runs/anchors}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PROFILE_VARIANTS=${PROFILE_VARIANTS:-ours,ours_qwide,ours_bm64,ours_bm128,ours_queue1,proto}
PROFILE_SHAPES=${PROFILE_SHAPES:-512:512:4,512:2048:4,512:8192:4,512:8192:8}   # h:M:k

run_item() {
    case "$1" in
        tests)
            make test-gpu-kernels GPU_PYTHON="$PY" 2>&1 | tee "$OUT/tests.log" | tail -n 5 ;;
        suite)      # every single-GPU test, one call: the kernels', then the rest
            local rc=0 jobs=${GPU_JOBS:-8}
            make test-gpu-kernels GPU_PYTHON="$PY" GPU_JOBS="$jobs" 2>&1 \
                | tee "$OUT/gpu_kernels.log" | tail -n 3 || rc=1
            if ! make test-gpu GPU_PYTHON="$PY" GPU_JOBS="$jobs" \
                    PYTEST_ARGS=--ignore=tests/kernels 2>&1 | tee "$OUT/gpu_other.log" | tail -n 3
            then    # make skips the serial part when the parallel one fails: run it anyway
                rc=1
                PYTHONPATH=src:tests $PY -m pytest -v -p no:cacheprovider \
                    -m "gpu and not multi_gpu and gpu_serial" --ignore=tests/kernels tests \
                    2>&1 | tee "$OUT/gpu_other_serial.log" | tail -n 3 || true
            fi
            return $rc ;;
        router)
            SWEEPS=M,k OUT="$OUT/router" ANCHORS="$ANCHORS" bash benchmarks/router_anchors_gpu.sh
            $PY benchmarks/router_profile.py --anchors "$ANCHORS" \
                --shapes "$PROFILE_SHAPES" --variants "$PROFILE_VARIANTS" \
                "$OUT/router/profile.jsonl" > /dev/null ;;
        experts)
            $PY -m moremoe.cli bench experts --shapes presets,phonebook,study --no-progress \
                --out "$OUT/experts.jsonl" | tee "$OUT/experts.txt" ;;
        tune)
            $PY -m moremoe.cli bench experts --tune --no-progress \
                --out "$OUT/tune_experts.jsonl" | tee "$OUT/tune_experts.txt" ;;
        phonebook)
            $PY -m moremoe.cli bench phonebook --modes compiled --no-progress \
                --out "$OUT/phonebook.jsonl" | tee "$OUT/phonebook.txt" ;;
        meta)
            $PY benchmarks/routing_meta_ab.py "$OUT/routing_meta.jsonl" \
                | tee "$OUT/routing_meta.txt" ;;
        inductor)
            $PY benchmarks/phonebook_inductor_ab.py "$OUT/phonebook_inductor.jsonl" \
                --variants "${INDUCTOR_VARIANTS:-combo,combo_mm}" \
                | tee "$OUT/phonebook_inductor.txt" ;;
        pair)
            MINUTES=${MINUTES:-1.3} KEEP=${KEEP:-table} OUT="$OUT/pair" \
                bash benchmarks/train_pair.sh ;;
    esac
}

KNOWN=" tests suite router experts tune phonebook meta pair inductor "
for item in ${ITEMS//,/ }; do        # every name checked before anything runs
    if [ "${KNOWN/ $item /}" = "$KNOWN" ]; then
        echo "error: ITEMS: unknown item '$item'; expected some of$KNOWN" >&2
        exit 2
    fi
done
if [ "${ITEMS//router/}" != "$ITEMS" ] && [ ! -f "$ANCHORS/fast_router.py" ]; then
    echo "error: $ANCHORS/fast_router.py not found; copy ../shared/anchors/*.py into" \
         "$ANCHORS and carry it" >&2
    exit 2
fi
# a call returns 8 files of $OUT at most: more are packed into $OUT/results.tgz on exit
trap 'bash benchmarks/pack_out.sh "$OUT" || true' EXIT
for item in ${ITEMS//,/ }; do
    start=$(date +%s)
    echo "issue54_gpu.sh: $item ..."
    run_item "$item"
    echo "issue54_gpu.sh: $item took $(( $(date +%s) - start )) s"
done
