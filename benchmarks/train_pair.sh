#!/usr/bin/env bash
# Training throughput of the matched MoE-256 / MoRE-1792 pair and of the same-shape MoE-1792
# (MoRE-1792's shape, standard router) on the same local text: each preset trains for MINUTES
# of wall clock (compilation included, set-up not) on one GPU, or with DDP over NPROC GPUs
# through torchrun, and its summary (mean step time after warm-up, tokens/s, MFU, peak
# memory), JSONL metrics, stderr log and (PROFILE_STEPS > 0) a profiler table land in OUT;
# then train_pair_table.py writes OUT/table.md (issue 27's table, today's numbers beside)
# and OUT/loss.png (loss against tokens, these runs and the committed ones). The text is
# Python's docs and standard library (`moremoe data corpus --python-source`, 15M GPT-2
# tokens): no network.
#
#   MINUTES=1.3 OUT=/tmp/pair benchmarks/train_pair.sh              # 3 presets, 1 GPU
#   MINUTES=1.3 NPROC=2 OUT=/tmp/pair2 benchmarks/train_pair.sh     # the matched pair, DDP
#   KEEP=table ...         OUT gets only what the table and the plot read (<= 8 files)
#   MIN_STEPS=20           a run that times fewer steps (a cold compile cache: MoRE-1792's
#                          first compile on a fresh H200 took 71 s) runs once more, warm
#   python benchmarks/train_pair_table.py OUT      # both layouts' files in one OUT: speed-up
#   PRESETS="tiny-moe tiny-more" DEVICE=cpu MINUTES=0.2 EXTRA="--set model.seq_len=64" ...
#
# Expected wall time on one H100 at MINUTES=1.3: ~15 s to build the data (README's times:
# 5 s + 7 s), then about 1.6 min a preset (1.3 of training, compilation included, and ~20 s
# of start-up and the final evaluation): ~5.5 min for the 3 presets; NPROC=2 with the 2
# presets of the matched pair: ~4 min.
# Exit status: one process ends a --max-minutes stop with 75, torchrun with 0 (every rank
# exits 0 after a checkpointed stop); either way the summary's "stopped" must say
# max_minutes or max_steps, else the script stops with the log's tail.
set -euo pipefail
MINUTES=${MINUTES:-10}
NPROC=${NPROC:-1}
OUT=${OUT:-runs/pair}        # summaries, metrics, logs, profiles, table, plot
KEEP=${KEEP:-all}            # all | table (summaries and metrics only; logs go to RUNS)
if [ "$KEEP" = table ]; then
    RUNS=${RUNS:-${TMPDIR:-/tmp}/moremoe_train_pair}; PROFILE_STEPS=${PROFILE_STEPS:-0}
else
    RUNS=${RUNS:-$OUT}; PROFILE_STEPS=${PROFILE_STEPS:-10}
fi
DEVICE=${DEVICE:-auto}
if [ "$NPROC" -gt 1 ]; then
    PRESETS=${PRESETS:-"h512-s64-moe256 h512-s64-more1792"}
else
    PRESETS=${PRESETS:-"h512-s64-moe256 h512-s64-more1792 h512-s56-moe1792"}
fi
DATA=${DATA:-$RUNS/data}      # an existing prepared folder is used as it is
VAL=${VAL:-500}               # validation sequences when the data is prepared here
EXTRA=${EXTRA:-}
# under torchrun the presets' compile_mode=auto takes no CUDA graphs yet (docs/design.md);
# the 2-GPU runs of benchmarks/NOTES.md name them: DDP_MODE=auto measures the default
DDP_MODE=${DDP_MODE:-reduce-overhead}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$OUT" "$RUNS"
if [ ! -f "$DATA/meta.json" ]; then
    $PY -m moremoe.cli data corpus "$RUNS/corpus" --python-source
    $PY -m moremoe.cli data prepare "$RUNS/corpus" --out "$DATA" --val-sequences "$VAL" --no-progress
fi
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=($PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m moremoe.cli)
else
    LAUNCH=($PY -m moremoe.cli)
fi
LOGS=$OUT; [ "$KEEP" = table ] && LOGS=$RUNS
MODE=""; [ "$NPROC" -gt 1 ] && MODE="--set train.compile_mode=$DDP_MODE"
MIN_STEPS=${MIN_STEPS:-20}   # a run that timed fewer steps (a cold compile cache) runs again
for preset in $PRESETS; do
    run="$RUNS/run_${preset}_x$NPROC"
    tag="${preset}_x$NPROC"
    for attempt in 1 2; do
        rm -rf "$run"
        rc=0
        # shellcheck disable=SC2086
        "${LAUNCH[@]}" train --preset "$preset" --data "$DATA" --out "$run" --device "$DEVICE" \
            --max-minutes "$MINUTES" --set train.save_on_stop=false \
            --set train.profile_steps="$PROFILE_STEPS" --set train.eval_every=1000000 --json \
            $MODE $EXTRA > "$OUT/$tag.json" 2> "$LOGS/$tag.log" || rc=$?
        read -r stopped steps < <($PY -c 'import json,sys; s = json.load(open(sys.argv[1]))
print(s["stopped"], s["steps_this_run"])' "$OUT/$tag.json" 2>/dev/null || echo none 0)
        { [ "$attempt" = 2 ] || [ "$stopped" != max_minutes ] || [ "$steps" -ge "$MIN_STEPS" ]; } \
            && break
        echo "$preset: $steps steps in $MINUTES min (its first compile took the time); once more"
    done
    # one process: 75 after --max-minutes (a checkpointed stop); torchrun: 0 on every rank
    if { [ "$rc" -ne 0 ] && [ "$rc" -ne 75 ]; } || { [ "$NPROC" -gt 1 ] && [ "$rc" -ne 0 ]; } \
       || { [ "$stopped" != max_minutes ] && [ "$stopped" != max_steps ]; }; then
        echo "$preset: exit status $rc, stopped: $stopped"; tail -20 "$LOGS/$tag.log"; exit 1
    fi
    cp "$run/log.jsonl" "$OUT/${tag}_log.jsonl"
    [ "$PROFILE_STEPS" -gt 0 ] && cp "$run/profile.txt" "$OUT/${tag}_profile.txt"
    $PY - "$OUT/$tag.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['name']:>10} x{s['world']}: {s['mean_step_ms']:.1f} ms/step, "
      f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * (s['mfu'] or 0):.1f} %, "
      f"{s['steps_this_run']} steps, peak {s['peak_memory_gib'] or 0:.1f} GiB, "
      f"stopped: {s['stopped']}")
EOF
done
$PY "$HERE/train_pair_table.py" "$OUT" --out "$OUT/table.md" --plot "$OUT/loss.png"
