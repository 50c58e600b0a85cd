#!/usr/bin/env bash
# Training throughput of a matched MoE / MoRE pair on the same local text: each preset trains
# for MINUTES of wall clock (after its set-up) on one GPU, or with DDP over NPROC GPUs, and
# its summary (mean step time after warm-up, tokens/s, MFU, peak memory), the stderr log, the
# JSONL metrics and a profiler table of 10 steps land in OUT. The text is Python's docs and
# standard library (`moremoe data corpus --python-source`, 15M GPT-2 tokens): no network.
#
#   MINUTES=4 NPROC=1 OUT=/tmp/pair benchmarks/train_pair.sh        (RUNS= for the run dirs)
#   MINUTES=4 NPROC=2 OUT=/tmp/pair benchmarks/train_pair.sh          # DDP through torchrun
#   python benchmarks/train_pair_table.py OUT                          # the table
#   PRESETS="tiny-moe tiny-more" DEVICE=cpu MINUTES=0.2 EXTRA="--set model.seq_len=64" ...
set -euo pipefail
MINUTES=${MINUTES:-10}
NPROC=${NPROC:-1}
OUT=${OUT:-runs/pair}        # summaries, logs, profiles
RUNS=${RUNS:-$OUT}           # run directories, corpus and prepared data
DEVICE=${DEVICE:-auto}
PRESETS=${PRESETS:-"h512-s64-moe256 h512-s64-more1792"}
DATA=${DATA:-$RUNS/data}      # an existing prepared folder is used as it is
VAL=${VAL:-500}               # validation sequences when the data is prepared here
EXTRA=${EXTRA:-}
PY=${PYTHON:-python3}

mkdir -p "$OUT" "$RUNS"
if [ ! -f "$DATA/meta.json" ]; then
    $PY -m moremoe.cli data corpus "$RUNS/corpus" --python-source
    $PY -m moremoe.cli data prepare "$RUNS/corpus" --out "$DATA" --val-sequences "$VAL" --no-progress
fi
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(torchrun --standalone --nproc_per_node "$NPROC" -m moremoe.cli)
else
    LAUNCH=($PY -m moremoe.cli)
fi
for preset in $PRESETS; do
    run="$RUNS/run_${preset}_x$NPROC"
    rm -rf "$run"
    # shellcheck disable=SC2086
    "${LAUNCH[@]}" train --preset "$preset" --data "$DATA" --out "$run" --device "$DEVICE" \
        --max-minutes "$MINUTES" --set train.save_on_stop=false --set train.profile_steps=10 \
        --set train.eval_every=1000000 --json $EXTRA > "$OUT/${preset}_x$NPROC.json" \
        2> "$OUT/${preset}_x$NPROC.log" || rc=$?
    # 75: stopped by --max-minutes with a checkpoint to resume from (the expected end here)
    if [ "${rc:-0}" -ne 0 ] && [ "${rc:-0}" -ne 75 ]; then
        tail -20 "$OUT/${preset}_x$NPROC.log"; exit 1
    fi
    rc=0
    cp "$run/profile.txt" "$OUT/${preset}_x${NPROC}_profile.txt" 2>/dev/null || true
    cp "$run/log.jsonl" "$OUT/${preset}_x${NPROC}_log.jsonl" 2>/dev/null || true
    $PY - "$OUT/${preset}_x$NPROC.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['name']:>10} x{s['world']}: {s['mean_step_ms']:.1f} ms/step, "
      f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * (s['mfu'] or 0):.1f} %, "
      f"{s['steps_this_run']} steps, peak {s['peak_memory_gib'] or 0:.1f} GiB")
EOF
done
