#!/usr/bin/env bash
# A device call returns at most 8 files of its $OUT (the rest are named in files_left_out and
# lost when the next call empties it). Run at the end of a call's script (issue54_gpu.sh
# does, on exit): where DIR holds more than MAX files (default 8), they go into one
# DIR/results.tgz (`tar xzf` it where the call's files land) and leave DIR; the prepared
# text and the runs' checkpoints of train_pair.sh (corpus/, data/, run_*/) are left out of
# the tar and deleted (they rebuild in seconds, and weigh megabytes). A folder of MAX files
# or fewer is left as it is.
#
#   bash benchmarks/pack_out.sh DIR [MAX]
set -euo pipefail
DIR=${1:?usage: pack_out.sh DIR [MAX]}
MAX=${2:-8}
if [ ! -d "$DIR" ]; then
    echo "error: pack_out.sh: $DIR is not a folder" >&2
    exit 2
fi
case "$MAX" in
    ''|*[!0-9]*) echo "error: pack_out.sh: MAX must be a whole number; got '$MAX'" >&2; exit 2 ;;
esac
cd "$DIR"
skip=(-path '*/corpus' -o -path '*/data' -o -path '*/run_*')
list=$(find . \( "${skip[@]}" \) -prune -o -type f ! -name results.tgz -print | sort)
count=$(printf '%s' "$list" | grep -c . || true)
if [ "$count" -le "$MAX" ]; then
    exit 0
fi
printf '%s\n' "$list" | tar czf results.tgz -T -
printf '%s\n' "$list" | while IFS= read -r f; do rm -f -- "$f"; done
find . \( "${skip[@]}" \) -prune -exec rm -rf {} +
find . -mindepth 1 -type d -empty -delete
echo "pack_out.sh: $count files packed into $DIR/results.tgz (tar xzf it)"
