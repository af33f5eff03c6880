#!/usr/bin/env bash
# Several single-GPU jobs in ONE device call, one track per GPU, at the same time:
#
#   TRACK0="bash launch/gemm_bench.sh" TRACK1="GPU_CHECK_PHASES=single bash launch/gpu_check.sh" bash launch/device_tracks.sh
#
# Each TRACK<i> runs with CUDA_VISIBLE_DEVICES=<i> and OUT=$OUT/track<i> (its logs and JSON), under a
# wall-clock limit (TRACK_BUDGET_S, default 540 s). The carried wheels are installed once, first (two
# tracks must not install into .site at once). At the end everything under $OUT is packed into
# $OUT/results.tgz (the device tool brings back at most 8 files), and each track's last lines and exit
# status are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/tracks.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
. launch/device_env.sh
BUDGET="${TRACK_BUDGET_S:-540}"
T0=$(date +%s)
say "=== $NGPU GPU(s); tracks: $(env | grep -c '^TRACK[0-9]=') budget ${BUDGET}s"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | tee -a "$LOG"
pids=()
names=()
for i in 0 1 2 3 4 5 6 7; do
  var="TRACK$i"
  cmd="${!var:-}"
  [ -n "$cmd" ] || continue
  mkdir -p "$OUT/track$i"
  say "track $i: $cmd"
  ( dir="$OUT/track$i"
    export CUDA_VISIBLE_DEVICES=$i OUT="$dir" STREAMRING_CHECK_TMP="/tmp/streamring-check-$i"
    timeout --kill-after=10 "$BUDGET" bash -c "$cmd" >"$dir/track.log" 2>&1
    echo "rc=$?" >"$dir/rc" ) &
  pids+=($!)
  names+=("$i")
done
wait "${pids[@]}"
for i in "${names[@]}"; do
  say "=== track $i: $(cat "$OUT/track$i/rc" 2>/dev/null) after $(( $(date +%s) - T0 ))s; last lines:"
  tail -25 "$OUT/track$i/track.log" | tee -a "$LOG"
done
# only a few files come back from $OUT: pack everything, keep the archive and the summary log
tar czf /tmp/results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -not -name tracks.log -delete && \
  mv /tmp/results.tgz "$OUT/results.tgz"
say "=== packed: $(du -h "$OUT/results.tgz" | cut -f1)"
