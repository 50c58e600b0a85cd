#!/usr/bin/env bash
# The phonebook reproduction (`moremoe phonebook reproduce`) on the GPUs of one machine, in
# the background (processes of their own session) so that it outlives one device call while
# the machine stays held, and copied into $OUT as it goes.
#
#   ACTION=start OUT=/tmp/o bash benchmarks/phonebook_repro_gpu.sh   # start, tests, watch
#   ACTION=watch SECONDS_=540 OUT=/tmp/o bash benchmarks/phonebook_repro_gpu.sh  # copy as it runs
#   ACTION=stop OUT=/tmp/o bash benchmarks/phonebook_repro_gpu.sh    # checkpoint, stop, copy
#
# PB_GROUPS: space-separated GPUS:POINTS:ARCH[:OPTIONS], one reproduce process each into
# runs/repro-N (default "0,1:h64-s8:both 2:h128-s8:moe 3:h64-s16:moe": a long failing run
# gets a GPU to itself soon), OPTIONS that group's own, commas for spaces ("2:rank:more:
# --ranks,4" and "3:rank:more:--ranks,8" put two rank searches on two GPUs), or '+' for
# spaces where a value is a comma list ("0:rank:both:--ranks+moe,8,16+--seed+1,2"); RESUME=1
# continues them (each runs/repro-N/trials.jsonl a journal); FIRST=N numbers the groups from N
# (groups started while earlier ones still run); EXTRA adds options to all. start then runs the phonebook GPU
# tests (TESTS=0 skips them) and the demo on the busy GPUs, and watches until SECONDS_
# (default 480) after the call began; DEMO=1 first runs `moremoe demo` alone, timed, into
# $OUT/demo.log. stop sends SIGTERM (each process checkpoints its runs,
# writes its report and exits 75) and waits. $OUT gets results.tar (every group's report,
# rows, journal, plots, log), checkpoints.tar (the small ones, under 15 MiB in all), the test
# log and summary.txt.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:?set OUT}
GROUPS_=${PB_GROUPS:-0,1:h64-s8:both 2:h128-s8:moe 3:h64-s16:moe}
ACTION=${ACTION:-start}
T0=${T0:-$(date +%s)}
mkdir -p "$OUT" "$ROOT/runs"
export PYTHONPATH="$ROOT/src:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MOREMOE_COMMIT=${MOREMOE_COMMIT:-$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
cd "$ROOT"

copy() {
  (cd runs && tar -cf "$OUT/results.tar" --exclude='trial_checkpoints' repro-* 2>/dev/null)
  small=$(find runs/repro-* -path '*/trial_checkpoints/*.pt' -size -15M -printf '%s %p\n' 2>/dev/null |
          sort -n | awk '{t += $1; if (t < 15 * 2^20) print $2}')
  rm -f "$OUT/checkpoints.tar" "$OUT"/bigckpt.part-*
  [ -n "$small" ] && tar -cf "$OUT/checkpoints.tar" $small 2>/dev/null
  # the newest larger checkpoint (under 60 MiB) in 15 MiB parts: what comes back is at most 8
  # files of 16 MiB; `cat bigckpt.part-* | tar -x` joins them (BIG=0 skips)
  big=$(find runs/repro-* -path '*/trial_checkpoints/*.pt' -size +15M -size -60M -printf '%T@ %p\n' \
        2>/dev/null | sort -rn | awk 'NR == 1 {print $2}')
  [ "${BIG:-1}" = 1 ] && [ -n "$big" ] && tar -cf - "$big" | split -b 15M -a 1 - "$OUT/bigckpt.part-"
  for log in runs/repro-*.log; do
    echo "== $log"
    grep -E ": (training with|resumed)|stopped after|rror" "$log" | tail -8
    tail -4 "$log"
  done > "$OUT/summary.txt" 2>/dev/null
}

alive() {
  for f in runs/repro-*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && return 0; done
  return 1
}

watch() {   # until $1 seconds after T0, or every process ended
  while alive && [ $(( $(date +%s) - T0 )) -lt "$1" ]; do sleep 20; copy; done
  copy
  echo "== $(date -u +%FT%TZ): $(alive && echo running || echo 'none running')"
  cat "$OUT/summary.txt"
}

case "$ACTION" in
  start)
    if [ "${DEMO:-0}" = 1 ]; then   # the demo alone on the machine first: its GPU time
      t=$(date +%s.%N)
      timeout -k 10 180 $PY -m moremoe.cli demo --out /tmp/pb-demo --force --no-progress \
        > "$OUT/demo.log" 2>&1
      echo "demo: exit $?, wall $(python3 -c "import time; print(round(time.time() - $t, 1))") s" \
        >> "$OUT/demo.log"
      tail -25 "$OUT/demo.log"
    fi
    i=${FIRST:-0}
    for group in $GROUPS_; do
      IFS=: read -r gpus points arch own <<< "$group"
      flags=()
      if [[ "${own:-}" == *+* ]]; then            # '+' between words: commas stay in values
        read -r -a flags <<< "${own//+/ }"
      elif [ -n "${own:-}" ]; then
        read -r -a flags <<< "${own//,/ }"
      fi
      [ "${RESUME:-0}" = 1 ] && flags+=(--resume)
      CUDA_VISIBLE_DEVICES=$gpus setsid nohup $PY -m moremoe.cli phonebook reproduce \
        --points "$points" --arch "$arch" --out "runs/repro-$i" "${flags[@]}" ${EXTRA:-} \
        > "runs/repro-$i.log" 2>&1 < /dev/null &
      echo $! > "runs/repro-$i.pid"
      echo "== repro-$i: pid $(cat runs/repro-$i.pid), GPUs $gpus, $points ($arch)"
      i=$((i + 1))
    done
    if [ "${TESTS:-1}" = 1 ]; then
      timeout -k 10 300 $PY -m pytest -q -m "gpu or not gpu" -p no:cacheprovider \
        tests/phonebook/test_phonebook_gpu.py tests/phonebook/test_step.py \
        > "$OUT/gpu_tests.log" 2>&1
      tail -3 "$OUT/gpu_tests.log"
      timeout -k 10 120 $PY -m moremoe.cli demo --out /tmp/pb-demo --force --no-progress \
        >> "$OUT/gpu_tests.log" 2>&1
      grep -E "memorises|Neither|Both|training time" "$OUT/gpu_tests.log"
    fi
    watch "${SECONDS_:-480}";;
  watch)
    watch "${SECONDS_:-540}";;
  stop)
    for f in runs/repro-*.pid; do kill -TERM "$(cat "$f")" 2>/dev/null; done
    for _ in $(seq 1 90); do alive || break; sleep 2; done
    copy
    echo "== stopped ($(date -u +%FT%TZ))"
    cat "$OUT/summary.txt";;
esac
