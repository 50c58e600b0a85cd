#!/usr/bin/env bash
# The wall time of each example command of README.md on this machine, for the README's
# table of expected times: one JSON line per command on stdout, also appended to
# benchmarks/results/<device>/readme_times.jsonl (or $OUT_JSONL).
#
#   bash benchmarks/readme_times.sh          # from anywhere; nothing is fetched
#
# Data is made here (`moremoe data corpus --python-source`, then `data prepare`), so no
# network is needed; commands that need one (the Hub's datasets, a downloaded MoE) or more
# GPUs than the machine has are listed as skipped, with why. Each command runs under
# a wall clock with a bound (seconds; $BOUND_SCALE multiplies them) and the whole
# script within $BUDGET_S seconds (default 460: under 8 minutes on an H100). A command cut
# by its bound gets SIGINT (runs checkpoint, reports keep what they have) and its row says
# "bounded": true, with its last progress line, whose rate ("~2m03s left") or step time
# gives the full command's time. Rows carry the device, versions, commit and date.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/readme-times.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
DEADLINE=$((SECONDS + ${BUDGET_S:-460}))
SCALE=${BOUND_SCALE:-1}
ENV_JSON=$($PY -c 'import json, torch
from moremoe.runtime import environment, resolve_device
print(json.dumps(environment(resolve_device("auto"))))') || exit 2
SLUG=$($PY -c 'from moremoe.bench.harness import device_slug
from moremoe.runtime import resolve_device
print(device_slug(resolve_device("auto")))') || exit 2
RESULTS=${OUT_JSONL:-$ROOT/benchmarks/results/$SLUG/readme_times.jsonl}
mkdir -p "$(dirname "$RESULTS")"
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')

row() {   # row README_COMMAND RAN RC BOUNDED [SKIPPED]: one JSON line from $WORK/{time,out,err}
  $PY - "$@" "$WORK" "$ENV_JSON" <<'PYTHON' | tee -a "$RESULTS"
import json, sys
from pathlib import Path
readme, ran, rc, bounded, skipped, work, env = sys.argv[1:]
work = Path(work)

def last_line(name, start="", within=""):
    path = work / name
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [ln.split("\r")[-1].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and ln.startswith(start) and within in ln]
    return lines[-1] if lines else None

try:
    seconds = float((work / "time").read_text().split()[-1])
except (OSError, ValueError, IndexError):
    seconds = None
out = {"command": readme, "ran": ran or None, "seconds": seconds,
       "exit": int(rc) if rc else None, "bounded": bounded == "1",
       "last_stderr": last_line("err"), "last_progress": last_line("err", within="elapsed"),
       "last_step": last_line("out", "step ")}
if skipped:
    out = {"command": readme, "skipped": skipped}
print(json.dumps({**out, **json.loads(env)}))
PYTHON
}

timed() {   # timed BOUND_S README_COMMAND ARGS...: run `moremoe ARGS...` in $WORK
  local bound=$(( $1 * SCALE )) readme=$2 left=$((DEADLINE - SECONDS)); shift 2
  rm -f "$WORK/time" "$WORK/out" "$WORK/err"
  if [ "$left" -lt 10 ]; then
    row "$readme" "" "" 0 "the script's time budget (BUDGET_S) ran out"; return
  fi
  [ "$bound" -gt "$left" ] && bound=$left
  local t0; t0=$(date +%s.%N)
  (cd "$WORK" && timeout -s INT -k 30 "$bound" $PY -m moremoe.cli "$@" >"$WORK/out" 2>"$WORK/err")
  local rc=$?
  $PY -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$t0" \
      "$(date +%s.%N)" > "$WORK/time"
  local cut=0; { [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; } && cut=1
  row "$readme" "moremoe $*" "$rc" "$cut" ""
}

skip() { row "$1" "" "" 0 "$2"; }

# data first: every later command reads it
timed 60 "moremoe data corpus corpus/ --python-source" data corpus corpus --python-source
timed 120 "moremoe data prepare corpus/ 'more/*.jsonl.gz' --out data/gpt2" \
    data prepare corpus --out data/gpt2
timed 60 "moremoe data verify data/gpt2" data verify data/gpt2
timed 120 "make demo (moremoe demo)" demo --out runs/demo
timed 30 "moremoe flops --experts 1792 --top-k 4 --width 56 --rank 64 --paper-model h512" \
    flops --experts 1792 --top-k 4 --width 56 --rank 64 --paper-model h512
timed 30 "moremoe plan --hidden 512 --width 64 --top-k 4 --rank 64" \
    plan --hidden 512 --width 64 --top-k 4 --rank 64
timed 60 "moremoe theory hypercube --rank 6 --top-k 4 --tokens 200000 --plot hypercube.png" \
    theory hypercube --rank 6 --top-k 4 --tokens 200000 --plot hypercube.png
timed 60 "moremoe theory rank --experts 256 --hidden 128 --top-k 4 --plot rank.png" \
    theory rank --experts 256 --hidden 128 --top-k 4 --plot rank.png
skip "moremoe convert-router path/to/Qwen3-30B-A3B --rank 16,64,256 --text sample.txt --out conv/" \
    "needs the downloaded checkpoint (Qwen3-30B-A3B, about 61 GB)"
# the 10-minute budget of the README's command cut to half a minute (compilation comes
# first): its step lines give the step time, hence any budget's steps
timed 110 "moremoe train --preset h512-s64-more1792 --data DIR --out runs/more1792 --max-minutes 10 (run with --max-minutes 0.5)" \
    train --preset h512-s64-more1792 --data data/gpt2 --out runs/more1792 --max-minutes 0.5
timed 45 "moremoe phonebook train --size 10000 --hidden 64 --width 8 --rank 16 --out runs/pb10k" \
    phonebook train --size 10000 --hidden 64 --width 8 --rank 16 --out runs/pb10k
timed 15 "moremoe phonebook capacity --sizes 3000,10000,30000,100000 --arch more --out runs/cap" \
    phonebook capacity --sizes 3000,10000,30000,100000 --arch more --out runs/cap
timed 15 "moremoe phonebook sweep --over rank --values 2,4,8,16,32 --size 10000 --out runs/pb-rank" \
    phonebook sweep --over rank --values 2,4,8,16,32 --size 10000 --out runs/pb-rank
timed 30 "moremoe data mixture --list --tokens 2e9" data mixture --list --tokens 2e9
skip "moremoe data mixture --recipe paper --tokens 2e9 --out data/mix" \
    "streams the sources from the Hugging Face Hub (network)"
timed 30 "moremoe train --list-presets" train --list-presets
timed 60 "moremoe train --preset tiny-more --data DIR --out runs/tiny --device cpu" \
    train --preset tiny-more --data data/gpt2 --out runs/tiny --device cpu
timed 60 "moremoe hf export runs/more/ hf/more (of runs/tiny)" hf export runs/tiny hf/tiny
timed 60 "moremoe generate runs/more/ --prompt ... --max-new-tokens 100 (of runs/tiny)" \
    generate runs/tiny --prompt "The history of the Roman Empire" --max-new-tokens 100
if [ "$GPUS" -lt 2 ]; then
  skip "torchrun --nproc_per_node 2 -m moremoe.cli train ..." "needs 2 GPUs, this machine has $GPUS"
fi
skip "moremoe eval runs/more/ --data data/mix --tasks triviaqa,... (and --tasks sciq --limit 100)" \
    "lm-eval downloads the tasks' datasets from the Hugging Face Hub (network)"
for b in router layer decode experts model peer; do   # rows to $WORK, not the results
  timed 15 "moremoe bench $b" bench "$b" --out "bench/$b.jsonl"
done
