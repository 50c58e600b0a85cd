#!/usr/bin/env bash
# DDP's step time on 2 GPUs against one GPU, for the paper pair (issue 27, part 2): each
# preset trains STEPS steps (the first WARMUP, which compile and record the CUDA graphs, left
# out of the mean) with its own compile settings (the whole model) in compile_mode MODE
# (reduce-overhead: CUDA graphs on one GPU and under DDP, where `auto` does not take them
# yet), once on one GPU and then under DDP over 2 GPUs at
# each parallel.bucket_mb in BUCKETS, reducing in each parallel.reduce_dtype in REDUCE. The
# one-GPU runs of the two presets run at once, one on each GPU. The data are random GPT-2
# token ids (the step's time does not depend on the text; nothing to prepare).
#
#   OUT=/tmp/ddp bash benchmarks/ddp_gpu.sh                  # 2 GPUs, about 4.5 minutes
#   TESTS=1 LIMIT_S=540 bash benchmarks/ddp_gpu.sh  # first the 2-GPU tests (~4 min more)
#   BUCKETS="25 100 400" REDUCE=bf16 bash benchmarks/ddp_gpu.sh
#   DEVICE=cpu PRESETS="tiny-moe tiny-more" STEPS=4 WARMUP=1 \
#     SETS="model.seq_len=64 train.batch_size=2 train.compile=false" bash benchmarks/ddp_gpu.sh
#
# Writes into $OUT (default benchmarks/results/ddp_gpu): ddp_gpu.txt (the table: ms/step,
# tokens/s, the speed-up of 2 GPUs over one, peak GiB), summaries.json (every run's summary)
# and runs.log (every run's output; with TESTS=1, the tests' too). Time: under LIMIT_S (290
# s) whatever happens; a run is started only with MIN_RUN_S left and stopped (TERM, then
# KILL) when the time is out, the table keeping what finished; the tests leave 200 s to the
# runs. Planned per run: ~10 s of set-up, the compile (~25 s for the whole model, less when
# inductor's cache holds its graphs), STEPS x 0.3 s. Exit status: 0 when every run (and
# test) passed, 1 when one failed or was left out, 2 without 2 GPUs.
set -uo pipefail
START=$SECONDS
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/ddp_gpu}
RUNS=${RUNS:-$ROOT/runs/ddp_gpu}
DEVICE=${DEVICE:-cuda}
PRESETS=${PRESETS:-"h512-s64-moe256 h512-s64-more1792"}
BUCKETS=${BUCKETS:-"25 100"}
REDUCE=${REDUCE:-"fp32 bf16"}
STEPS=${STEPS:-16}
WARMUP=${WARMUP:-6}
LIMIT_S=${LIMIT_S:-290}
MIN_RUN_S=${MIN_RUN_S:-45}
SETS=${SETS:-}
MODE=${MODE:-reduce-overhead}        # train.compile_mode of every run
TESTS=${TESTS:-0}
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT" || exit 1
mkdir -p "$OUT" "$RUNS/summaries"
rm -f "$OUT"/{ddp_gpu.txt,summaries.json,runs.log} "$RUNS"/summaries/*.{json,txt}
left() { echo $((LIMIT_S - (SECONDS - START))); }
say() { echo "== $* ($((SECONDS - START)) s)" | tee -a "$OUT/runs.log"; }

if [ "$DEVICE" = cuda ]; then
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    if [ "$GPUS" -lt 2 ]; then
        echo "ddp_gpu.sh: error: needs 2 GPUs, this machine has $GPUS" >&2
        exit 2
    fi
fi
"$PY" - "$RUNS/data" <<'EOF'        # random ids in `moremoe data prepare`'s format
import json, sys
from pathlib import Path
import numpy as np
out, T, rows = Path(sys.argv[1]), 1024, 2048
out.mkdir(parents=True, exist_ok=True)
ids = np.random.default_rng(0).integers(0, 50256, size=(rows + 64, T), dtype=np.uint16)
ids[64:].tofile(out / "train.bin")
ids[:64].tofile(out / "val.bin")
(out / "meta.json").write_text(json.dumps({
    "format": "moremoe-tokens", "version": 1, "tokenizer": "gpt2", "vocab_size": 50257,
    "eot_id": 50256, "seq_len": T, "dtype": "uint16", "train_sequences": rows,
    "val_sequences": 64, "seed": 0, "sources": ["random"], "documents": 0,
    "tokens": (rows + 64) * T, "sha256": {}}))
EOF

failed=0
if [ "$TESTS" = 1 ]; then         # DDP against one GPU, CUDA graphs, bf16, resume
    say "GPU tests: tests/training/test_ddp_gpu.py"
    timeout --kill-after=10 $(($(left) - 200)) "$PY" -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/training/test_ddp_gpu.py >>"$OUT/runs.log" 2>&1 || failed=1
    tail -3 "$OUT/runs.log"
fi

run() {           # NAME NPROC GPU_LIST [--set ...]: one run, its summary into RUNS/summaries
    local name=$1 nproc=$2 gpus=$3 limit rc
    shift 3
    limit=$(($(left) - 10))
    if [ "$limit" -lt "$MIN_RUN_S" ]; then
        say "$name left out: $(left) s left"
        echo "$name" >>"$RUNS/summaries/left_out.txt"
        return 1
    fi
    local sets=()
    for s in $SETS; do sets+=(--set "$s"); done
    rm -rf "$RUNS/$name"
    CUDA_VISIBLE_DEVICES=$gpus timeout --kill-after=10 "$limit" "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node "$nproc" -m moremoe.cli train --data "$RUNS/data" \
        --out "$RUNS/$name" --device "$DEVICE" --max-steps "$STEPS" \
        --set train.timing_warmup="$WARMUP" --set train.log_every=5 \
        --set train.eval_every=1000000 --set train.eval_batches=1 \
        --set train.save_on_stop=false --set train.compile_mode="$MODE" "${sets[@]}" "$@" \
        >"$RUNS/$name.log" 2>&1
    rc=$?
    { echo "== $name: exit $rc"; grep -v "^\s*$" "$RUNS/$name.log" | tail -6; } >>"$OUT/runs.log"
    [ -f "$RUNS/$name/summary.json" ] && cp "$RUNS/$name/summary.json" "$RUNS/summaries/$name.json"
    rm -rf "$RUNS/$name"
    return "$rc"
}

say "one GPU each: $PRESETS"
gpu=0
pids=()
for preset in $PRESETS; do         # both at once, one on each GPU
    run "${preset}_x1" 1 "$gpu" --preset "$preset" &
    pids+=($!)
    gpu=$(((gpu + 1) % 2))
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for bucket in $BUCKETS; do
    for reduce in $REDUCE; do
        for preset in $PRESETS; do
            say "$preset on 2 GPUs, parallel.bucket_mb=$bucket, parallel.reduce_dtype=$reduce"
            run "${preset}_x2_${reduce}_${bucket}mb" 2 0,1 --preset "$preset" \
                --set parallel.bucket_mb="$bucket" --set parallel.reduce_dtype="$reduce" ||
                failed=1
        done
    done
done

"$PY" - "$RUNS/summaries" "$OUT" <<'EOF' | tee "$OUT/ddp_gpu.txt"
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
(Path(sys.argv[2]) / "summaries.json").write_text(json.dumps(runs, indent=1))
one = {s["preset"]: s for n, s in runs.items() if s["world"] == 1}
print(f"{'run':<42} {'compile':<24} {'ms/step':>8} {'tokens/s':>10} {'x one GPU':>9} "
      f"{'peak GiB':>8}")
for name, s in runs.items():
    ms, tok = s["mean_step_ms"], s["tokens_per_s"]
    base = one.get(s["preset"])
    up = tok / base["tokens_per_s"] if base and tok and base["tokens_per_s"] else None
    print(f"{name:<42} {str(s['compile']):<24} {ms or 0:>8.1f} {tok or 0:>10,.0f} "
          f"{up or 0:>9.2f} {s['peak_memory_gib'] or 0:>8.1f}")
left = Path(sys.argv[1]) / "left_out.txt"
if left.exists():
    print("left out (no time): " + ", ".join(left.read_text().split()))
env = next(iter(runs.values()), {})
print(" ".join(f"{k[4:]}={v}" for k, v in env.items() if k.startswith("env_")))
EOF
say "done, exit $failed"
exit "$failed"
