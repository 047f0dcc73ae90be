#!/usr/bin/env bash
# Decode speed on a mixture-of-experts model larger than RAM: diskformer with its experts paged
# through a bounded host cache (--ram-budget) against llama.cpp's default mmap, same file, same
# threads, alternating rounds.
#
# Usage: bench/larger-than-ram.sh
# Environment (defaults in brackets):
#   SHAPE [qwen3-30b-a3b]  TYPE [Q8_0] (30.25 GiB of data: larger than a 24 GiB machine's RAM)
#   SKEW [0]               `diskformer synth --routing-skew`: router popularity skew (0: uniform routing)
#   RAM_BUDGET [8G]        diskformer's --ram-budget    POLICY [lfu] its --cache-policy
#   THREADS [2]  ROUNDS [2]  P [16] prompt tokens  N [16] generated tokens
#   MODELS_DIR [models/]   PEER_BIN (folder of llama-bench; default: ../shared/tools/build-llama-cpp.sh)
#   DF                     a prebuilt diskformer binary (default: cargo build --release here)
#
# It refuses to start when the model would not fit on disk with 5 GiB to spare, and says so when
# the model is not larger than this machine's RAM (the comparison is then not the one intended).
# Raw results: $MODELS_DIR/bench-larger-than-ram-<date>.jsonl; diskformer's per-layer cache
# statistics of each round go to the same folder (.stats.txt).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
SHAPE=${SHAPE:-qwen3-30b-a3b}
TYPE=${TYPE:-Q8_0}
SKEW=${SKEW:-0}
RAM_BUDGET=${RAM_BUDGET:-8G}
POLICY=${POLICY:-lfu}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
P=${P:-16}
N=${N:-16}
MODELS_DIR=${MODELS_DIR:-$repo/models}
mkdir -p "$MODELS_DIR"

if [ -z "${DF:-}" ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
  cargo build --release -p cli --no-default-features >&2
  DF="$CARGO_TARGET_DIR/release/diskformer"
fi
if [ -z "${PEER_BIN:-}" ]; then
  PEER_BIN=$("$repo/../shared/tools/build-llama-cpp.sh" | tail -1)
fi
LB="$PEER_BIN/llama-bench"
[ -x "$LB" ] || { echo "no llama-bench at $LB" >&2; exit 1; }

model="$MODELS_DIR/synth-$SHAPE-$(echo "$TYPE" | tr A-Z a-z)-skew$SKEW.gguf"
if [ ! -f "$model" ]; then
  need_gib=$("$DF" synth --list | awk -v s="$SHAPE" '$1 == s { print int($4 * 2 + 1) }')  # Q4_0 GB x 2 bounds Q8_0
  free_gib=$(df -BG --output=avail "$MODELS_DIR" | tail -1 | tr -dc 0-9)
  if [ -n "$need_gib" ] && [ "$free_gib" -lt $((need_gib + 5)) ]; then
    echo "only ${free_gib} GiB free in $MODELS_DIR; $SHAPE $TYPE needs about ${need_gib} GiB plus 5 to spare" >&2
    exit 1
  fi
  "$DF" synth --shape "$SHAPE" --type "$TYPE" --seed 1 --routing-skew "$SKEW" -t "$THREADS" --out "$model" >&2
fi
size_bytes=$(stat -c %s "$model")
ram_bytes=$(awk '/MemTotal/ { print $2 * 1024 }' /proc/meminfo)
if [ "$size_bytes" -le "$ram_bytes" ]; then
  echo "note: $model ($size_bytes B) fits in RAM ($ram_bytes B): this is not a larger-than-RAM run" >&2
fi

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out="$MODELS_DIR/bench-larger-than-ram-$stamp.jsonl"
: > "$out"
for r in $(seq 1 "$ROUNDS"); do
  df_json=$("$DF" bench -m "$model" -p "$P" -n "$N" -r 1 -t "$THREADS" --ram-budget "$RAM_BUDGET" \
    --cache-policy "$POLICY" --stats --json 2>"$MODELS_DIR/bench-larger-than-ram-$stamp-round$r.stats.txt")
  lb_json=$("$LB" -m "$model" -p "$P" -n "$N" -r 1 -t "$THREADS" -o json 2>/dev/null)
  python3 - "$r" "$df_json" "$lb_json" >> "$out" <<'PY'
import json, sys
r, df, lb = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
pp = next(x["avg_ts"] for x in lb if x["n_prompt"] > 0 and x["n_gen"] == 0)
tg = next(x["avg_ts"] for x in lb if x["n_gen"] > 0 and x["n_prompt"] == 0)
print(json.dumps({"round": r, "df_pp": df["pp_tok_s"], "df_tg": df["tg_tok_s"], "lb_pp": pp, "lb_tg": tg,
                  "ram_budget_bytes": df.get("ram_budget_bytes"), "size_bytes": df["size_bytes"]}))
PY
  tail -1 "$out" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
print("round %d: pp diskformer %.2f llama.cpp %.2f; tg diskformer %.2f llama.cpp %.2f tok/s"
      % (d["round"], d["df_pp"], d["lb_pp"], d["df_tg"], d["lb_tg"]))' >&2
done

python3 - "$out" "$model" "$RAM_BUDGET" "$POLICY" "$THREADS" "$P" "$N" <<'PY'
import json, statistics, sys
path, model, budget, policy, t, p, n = sys.argv[1:8]
rows = [json.loads(l) for l in open(path)]
def ms(v):
    return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
print(f"{model}: {rows[0]['size_bytes'] / 2**30:.2f} GiB; diskformer --ram-budget {budget} --cache-policy {policy} "
      f"vs llama.cpp mmap; threads {t}, {len(rows)} alternating rounds; raw: {path}\n")
print("| test | diskformer t/s | llama.cpp t/s | diskformer / llama.cpp |")
print("|---|---|---|---|")
for test, k, size in (("pp", "pp", p), ("tg", "tg", n)):
    d, l = ms([r["df_" + k] for r in rows]), ms([r["lb_" + k] for r in rows])
    print(f"| {test}{size} | {d[0]:.2f} ± {d[1]:.2f} | {l[0]:.2f} ± {l[1]:.2f} | {d[0] / l[0]:.3f} |")
PY
