#!/usr/bin/env bash
# A/B of diskformer's own settings inside one process: each run decodes with DISKFORMER_AB=NAME,
# which switches the setting NAME on for odd decode steps only (compute::ab), so both arms share
# the machine's state step by step (on the H200 leases separate processes of one binary drift
# 5-10%, more than most changes are worth). Every round runs each name once, the control `none`
# (nothing switched: the noise, 0.993 in one H200 run) first. Prints each run's B/A
# speed (the odd steps' over the even steps', by mean step time) and each name's mean.
#
# Usage: bench/ab-steps.sh MODEL.gguf NAME...
#   names in use: park, map (with DISKFORMER_MAPPED_EXPERTS=huge), alloc, signal, qknorm, qkfuse, router, submit, attnsplit, addnorm, gpufirst, touch, ffnnorm, ahead, pace, prefetch (with DISKFORMER_SPLIT_PREFETCH=1), copyq (with DISKFORMER_SPLIT_COPY_REFILLS=1), shared, spawned, pollspawn, cpuguess, prodspawn, contig, longidle, ralines, ranks, lastpf, kmadd, outsidestep (compute::ab)
# Environment (defaults in brackets): ROUNDS [2]   N [64]   REPS [3]   THREADS [0: every core]
#   WARMUP [1: one untimed run first; 0: none]
#   FLAGS [--gpu-budget 4G]   DF [target/release/diskformer, else BIN/diskformer]
#
# Example on lavapipe with a ../shared fixture:
#   FLAGS="--gpu-budget 96M --moe-miss split" N=16 bench/ab-steps.sh \
#     ../shared/fixtures/qwen3_moe/model-q4_k_m.gguf alloc
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:?usage: bench/ab-steps.sh MODEL.gguf NAME...}
shift
[ $# -gt 0 ] || { echo "name at least one setting (park, map, alloc, signal, qknorm, qkfuse, router, submit, attnsplit, addnorm, gpufirst, touch, ffnnorm, ahead, pace, prefetch, copyq, shared, spawned, pollspawn, cpuguess, prodspawn, contig, longidle, ralines, ranks, lastpf, kmadd, outsidestep)" >&2; exit 1; }
ROUNDS=${ROUNDS:-2}
N=${N:-64}
REPS=${REPS:-3}
THREADS=${THREADS:-0}
WARMUP=${WARMUP:-1}
FLAGS=${FLAGS:---gpu-budget 4G}
DF=${DF:-$repo/target/release/diskformer}
[ -x "$DF" ] || DF=${BIN:-$repo/.gpubin}/diskformer
[ -x "$DF" ] || { echo "no diskformer at $DF (cargo build --release -p cli --features gpu, or set DF)" >&2; exit 1; }
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
results=$(mktemp)
trap 'rm -f "$results"' EXIT
if [ "$WARMUP" != 0 ]; then
  # The first run after a model is written (or copied) read 1.24-1.27 for the control on the
  # H200 where later ones read ~1.01 (thirty-seventh session): one untimed run first.
  # shellcheck disable=SC2086 # FLAGS is a list of flags
  "$DF" bench -m "$model" -p 0 -n "$N" -r 1 -t "$THREADS" $FLAGS --json >/dev/null 2>&1 \
    || echo "warm-up run failed (going on)" >&2
fi
for ((round = 1; round <= ROUNDS; round++)); do
  for name in none "$@"; do
    extra=()
    [ "$name" = map ] && extra=(DISKFORMER_MAPPED_EXPERTS=huge)
    # shellcheck disable=SC2086 # FLAGS is a list of flags
    json=$(env "${extra[@]}" DISKFORMER_AB="$name" "$DF" bench -m "$model" -p 0 -n "$N" -r "$REPS" -t "$THREADS" \
      $FLAGS --json 2>/dev/null) || { echo "round $round $name: bench failed" >&2; continue; }
    line=$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); ab=j["ab"]
print("%s\t%.4f\t%.2f" % (ab["name"], ab["a_step_s"] / ab["b_step_s"], j["tg_tok_s"]))' "$json")
    echo "$line" >>"$results"
    echo "round $round: $(echo "$line" | awk -F'\t' '{printf "%-8s B/A %s (tg %s tok/s)", $1, $2, $3}')"
  done
done
python3 - "$results" <<'PY'
import sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, ratio, _ = line.rstrip("\n").split("\t")
    runs[name].append(float(ratio))
for name, r in runs.items():
    print(f"{name:8s} B/A mean {sum(r)/len(r):.4f}  runs {', '.join(f'{x:.4f}' for x in r)}")
PY
