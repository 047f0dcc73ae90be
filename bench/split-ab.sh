#!/usr/bin/env bash
# A/B of diskformer's own settings on one model, in alternating rounds: each round runs every
# configuration once, so that a lease whose speed drifts (10-20% within minutes on the H200)
# moves them all alike. Prints each run's decode tok/s with its `--stats` lines for the GPU
# tier's split (the CPU's share, the jobs' and the dispatcher's times), then each configuration's
# runs and mean; with TRACE=1, one more run of the first configuration under DISKFORMER_TRACE,
# summarized by bench/trace-summary.py.
#
# Usage: bench/split-ab.sh MODEL.gguf
# Environment (defaults in brackets):
#   CONFIGS ["default:;readback:DISKFORMER_SPLIT_MAILBOX=0"]  configurations, `;`-separated, each
#                          `name:VAR=VALUE,VAR=VALUE` (an empty list after the colon: no variable)
#   ROUNDS [3]   N [64] generated tokens   REPS [2]   THREADS [0: every core]
#   FLAGS [--gpu-budget 4G]   more `diskformer bench` flags (the tier's)
#   DF [target/release/diskformer, else BIN/diskformer]   TRACE [0]
#   OUT [$OUT or /tmp]     each run's --stats output (split-ab-<date>-<name>-<round>.txt)
#
# Example on lavapipe (a small synthetic model; the mailboxes are declined there, so both
# configurations take the readback path):
#   target/release/diskformer synth --shape qwen3-30b-a3b --type Q4_K --vocab 2048 \
#     --params n_layer=4,n_embd=256,n_expert=32,n_expert_used=4,n_ff_exp=256,n_ff=512 --out /tmp/s.gguf
#   FLAGS="--gpu-budget 104M" N=8 ROUNDS=2 bench/split-ab.sh /tmp/s.gguf
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
model=${1:?usage: bench/split-ab.sh MODEL.gguf}
CONFIGS=${CONFIGS:-"default:;readback:DISKFORMER_SPLIT_MAILBOX=0"}
ROUNDS=${ROUNDS:-3}
N=${N:-64}
REPS=${REPS:-2}
THREADS=${THREADS:-0}
FLAGS=${FLAGS:---gpu-budget 4G}
TRACE=${TRACE:-0}
out_dir=${OUT:-/tmp}
DF=${DF:-$repo/target/release/diskformer}
[ -x "$DF" ] || DF=${BIN:-$repo/.gpubin}/diskformer
[ -x "$DF" ] || { echo "no diskformer at $DF (cargo build --release -p cli --features gpu, or set DF)" >&2; exit 1; }
# The Vulkan loader and the NVIDIA ICD on the device machine, as bench/paged.sh finds them.
if ! ldconfig -p | grep -q libvulkan.so.1; then
  for f in "$repo"/.gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
  ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
mkdir -p "$out_dir"
stamp=$(date -u +%Y%m%dT%H%M%SZ)

IFS=';' read -r -a configs <<<"$CONFIGS"
names=()
for c in "${configs[@]}"; do names+=("${c%%:*}"); done
results="$out_dir/split-ab-$stamp.tsv"
: >"$results"

# Runs configuration $1 (name:vars) once; appends "name<TAB>tok/s" to the results.
run() {
  local name=${1%%:*} vars=${1#*:} stats tok
  stats="$out_dir/split-ab-$stamp-$name-$2.txt"
  local envs=()
  [ -n "$vars" ] && IFS=',' read -r -a envs <<<"$vars"
  # shellcheck disable=SC2086 # FLAGS is a list of flags
  tok=$(env "${envs[@]}" "$DF" bench -m "$model" -p 0 -n "$N" -r "$REPS" -t "$THREADS" $FLAGS --stats --json \
    2>"$stats" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["tg_tok_s"], 2))') \
    || { echo "$name round $2: failed (see $stats)"; tail -3 "$stats"; return 0; }
  printf '%s\t%s\n' "$name" "$tok" >>"$results"
  echo "$name round $2: tg$N $tok tok/s"
  grep -E '^(split:|tier host time)' "$stats" | cut -c1-400 | sed 's/^/    /' || true
}

for ((round = 1; round <= ROUNDS; round++)); do
  for c in "${configs[@]}"; do run "$c" "$round"; done
done

echo
echo "$model, tg$N x $REPS, $ROUNDS alternating rounds, flags: $FLAGS"
python3 - "$results" "${names[@]}" <<'PY'
import sys, statistics
path, names = sys.argv[1], sys.argv[2:]
runs = {n: [] for n in names}
for line in open(path):
    name, tok = line.rstrip("\n").split("\t")
    runs[name].append(float(tok))
for n in names:
    v = runs[n]
    mean = f"{statistics.mean(v):.2f}" if v else "-"
    print(f"{n:24s} mean {mean:>8s}  runs {', '.join(f'{x:.2f}' for x in v)}")
PY

if [ "$TRACE" = 1 ]; then
  first=${configs[0]}
  vars=${first#*:}
  envs=()
  [ -n "$vars" ] && IFS=',' read -r -a envs <<<"$vars"
  trace="$out_dir/split-ab-$stamp-trace.tsv"
  # shellcheck disable=SC2086 # FLAGS is a list of flags
  env "${envs[@]}" DISKFORMER_TRACE="$trace" "$DF" bench -m "$model" -p 0 -n "$N" -r 1 -t "$THREADS" $FLAGS \
    >/dev/null 2>&1 || echo "the trace run failed"
  [ -f "$trace" ] && python3 "$repo/bench/trace-summary.py" "$trace" --skip-steps 10
fi
