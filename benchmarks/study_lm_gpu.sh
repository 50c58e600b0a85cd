#!/usr/bin/env bash
# The language-model study (issue 51) in one device call, continued over the calls of a
# window and over windows: the corpus of the machine's installed packages (`moremoe data
# corpus --packages`, then `data prepare --val-input`), then `moremoe study lm` until the
# call's time is spent, its runs checkpointed on the machine's disk (WORK) for the next call
# of the same window. A fresh machine starts the study from the committed study.json and
# rows.jsonl (RESULTS), so no finished run is trained again; a run cut by the end of a window
# starts over in the next (its checkpoints do not leave the machine). $OUT gets one tar of the
# study's rows, report, figures, logs and the corpus's and data's records: extract it into
# RESULTS and commit.
#
#   OUT=/tmp/o bash benchmarks/study_lm_gpu.sh                       # the pair (3a)
#   EXPERIMENTS=experts,rank OUT=/tmp/o bash benchmarks/study_lm_gpu.sh
#   CALL_MINUTES=9.3 ...   the whole call's budget (the device's limit is 10 minutes)
#   STUDY_ARGS="--seeds 0,1,2 --budgets 60e6,120e6" ...   anything `moremoe study lm` takes;
#                    in a window's last call "--start-minutes 1" begins no run that could
#                    not end before the machine (and its checkpoints) goes
#   PARALLEL=4 ...   runs at once on the GPU (default 4 on a GPU of over 100 GB, else 2: the
#                    h = 256 pair's steps measured 1.61M tokens/s in all with four, 1.25M
#                    with two on an H200; 21 GiB a MoRE process, 6 GiB more to evaluate)
#   DEVICE=cpu PARALLEL=1 WORK=/tmp/w RESULTS=/tmp/r STUDY_ARGS="--hidden 32 ..." ... on a CPU
#
# Measured on one H200 (2026-12-05, NOTES "The language-model pair, first rows"): the corpus
# 15 s and its tokens about 10 s with 14 workers (176.7M GPT-2 tokens); the h = 256, L = 6
# pair at 94 ms (MoE-256) and 118 ms (MoRE-1920) a step two at a time, about 163 ms four at
# a time (400K tokens/s each), plus a compile of about 40 s a process; a fresh machine
# spends about 4.5 minutes starting.
set -euo pipefail
START=$(date +%s)
CALL_MINUTES=${CALL_MINUTES:-9.3}
EXPERIMENTS=${EXPERIMENTS:-pair}
STUDY_ARGS=${STUDY_ARGS:-}
DEVICE=${DEVICE:-auto}
WORK=${WORK:-/tmp/moremoe_study}
RESULTS=${RESULTS:-benchmarks/results/nvidia-h200/study_lm}
WORKERS=${WORKERS:-14}
# four fit an H200 (141 GB); on an H100 (80 GB) three did not: MoRE-1920's first evaluation
# asked 6.1 GiB beside two MoE-256 runs (2026-12-05, NOTES): two a GPU under 100 GB
PARALLEL=${PARALLEL:-$(${PYTHON:-python3} -c "import torch; print(4 if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100e9 else 2)" 2>/dev/null || echo 2)}
OUT=${OUT:-runs/study_lm_out}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}

mkdir -p "$WORK" "$OUT"
OUT=$(cd "$OUT" && pwd)         # the tar is written from inside the study's folder
if [ ! -f "$WORK/corpus/corpus.json" ]; then
    $PY -m moremoe.cli data corpus "$WORK/corpus" --packages --workers "$WORKERS" --force \
        --no-progress --json > "$WORK/corpus_report.json"
fi
if [ ! -f "$WORK/data/meta.json" ]; then
    $PY -m moremoe.cli data prepare "$WORK/corpus/train.jsonl" --val-input \
        "$WORK/corpus/val.jsonl" --out "$WORK/data" --workers "$WORKERS" --no-progress --json \
        > "$WORK/prepare_report.json"
fi
mkdir -p "$WORK/study"
if [ ! -f "$WORK/study/study.json" ] && [ -f "$RESULTS/study.json" ]; then
    cp "$RESULTS/study.json" "$WORK/study/"                         # a fresh machine
    if [ -f "$RESULTS/rows.jsonl" ]; then cp "$RESULTS/rows.jsonl" "$WORK/study/"; fi
fi
left=$($PY -c "import time; print(max(0.5, $CALL_MINUTES - (time.time() - $START) / 60 - 0.4))")
rc=0
# shellcheck disable=SC2086
$PY -m moremoe.cli study lm --data "$WORK/data" --out "$WORK/study" --experiments "$EXPERIMENTS" \
    --device "$DEVICE" --max-minutes "$left" --parallel "$PARALLEL" --no-progress $STUDY_ARGS \
    > "$WORK/study/last_command.txt" 2> "$WORK/study/last_command.err" || rc=$?
cp "$WORK/corpus/corpus.json" "$WORK/study/corpus.json"
cp "$WORK/data/meta.json" "$WORK/study/data_meta.json"
(cd "$WORK/study" && tar czf "$OUT/study_lm.tar.gz" --exclude=runs --exclude=specs --exclude=.lock .)
tail -n 40 "$WORK/study/last_command.err"
cat "$WORK/study/last_command.txt"
echo "study_lm_gpu.sh: moremoe study lm exited $rc after $(( $(date +%s) - START )) s"
[ "$rc" = 0 ] || [ "$rc" = 75 ]
