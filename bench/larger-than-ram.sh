#!/usr/bin/env bash
# Decode speed on a mixture-of-experts model larger than RAM: diskformer with its experts paged
# through a bounded host cache (--ram-budget) against llama.cpp's default mmap, same file, same
# threads, alternating rounds; with the expert cache's hit rate, the bytes read from disk per
# decoded token, and the physical limit those bytes and the disk's measured bandwidth allow.
#
# Usage: bench/larger-than-ram.sh
# Environment (defaults in brackets):
#   SHAPE [qwen3-30b-a3b]  TYPE [Q8_0] (30.25 GiB of data: larger than a 24 GiB machine's RAM)
#   PARAMS []              `diskformer synth --params` over the shape (e.g. small dims to prove the script)
#   SKEW [0]               `diskformer synth --routing-skew`: router popularity skew (0: uniform routing)
#   RAM_BUDGET [8G]        diskformer's --ram-budget    POLICY [lfu] its --cache-policy
#   PREFETCH [0]  DIRECT_IO [1]   diskformer's --prefetch and --direct-io (1: on)
#   THREADS [2]  ROUNDS [2]  P [16] prompt tokens  N [16] generated tokens
#   PEER [1]               0: diskformer only (no llama.cpp build or run)
#   MODELS_DIR [models/]   PEER_BIN (folder of llama-bench; default: ../shared/tools/build-llama-cpp.sh)
#   DF                     a prebuilt diskformer binary (default: cargo build --release here)
#   DD_MIB [1024]  DD_STREAMS [8]   MiB read with O_DIRECT (dd, 1 MiB blocks, DD_STREAMS at once) to
#                          measure the disk's bandwidth
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
PARAMS=${PARAMS:-}
SKEW=${SKEW:-0}
RAM_BUDGET=${RAM_BUDGET:-8G}
POLICY=${POLICY:-lfu}
PREFETCH=${PREFETCH:-0}
DIRECT_IO=${DIRECT_IO:-1}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
P=${P:-16}
N=${N:-16}
PEER=${PEER:-1}
DD_MIB=${DD_MIB:-1024}
MODELS_DIR=${MODELS_DIR:-$repo/models}
mkdir -p "$MODELS_DIR"

if [ -z "${DF:-}" ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
  cargo build --release -p cli --no-default-features >&2
  DF="$CARGO_TARGET_DIR/release/diskformer"
fi
LB=""
if [ "$PEER" = 1 ]; then
  if [ -z "${PEER_BIN:-}" ]; then
    PEER_BIN=$("$repo/../shared/tools/build-llama-cpp.sh" | tail -1)
  fi
  LB="$PEER_BIN/llama-bench"
  [ -x "$LB" ] || { echo "no llama-bench at $LB" >&2; exit 1; }
fi

tag=""
[ -n "$PARAMS" ] && tag="-$(echo "$PARAMS" | tr ',=' '-_')"
model="$MODELS_DIR/synth-$SHAPE$tag-$(echo "$TYPE" | tr A-Z a-z)-skew$SKEW.gguf"
if [ ! -f "$model" ]; then
  if [ -z "$PARAMS" ]; then
    need_gib=$("$DF" synth --list | awk -v s="$SHAPE" '$1 == s { print int($4 * 2 + 1) }')  # Q4_0 GB x 2 bounds Q8_0
    free_gib=$(df -BG --output=avail "$MODELS_DIR" | tail -1 | tr -dc 0-9)
    if [ -n "$need_gib" ] && [ "$free_gib" -lt $((need_gib + 5)) ]; then
      echo "only ${free_gib} GiB free in $MODELS_DIR; $SHAPE $TYPE needs about ${need_gib} GiB plus 5 to spare" >&2
      exit 1
    fi
  fi
  "$DF" synth --shape "$SHAPE" --params "$PARAMS" --type "$TYPE" --seed 1 --routing-skew "$SKEW" -t "$THREADS" \
    --out "$model" >&2
fi
size_bytes=$(stat -c %s "$model")
ram_bytes=$(awk '/MemTotal/ { printf "%.0f", $2 * 1024 }' /proc/meminfo)
if [ "$size_bytes" -le "$ram_bytes" ]; then
  echo "note: $model ($size_bytes B) fits in RAM ($ram_bytes B): this is not a larger-than-RAM run" >&2
fi

# The disk's O_DIRECT read bandwidth with DD_STREAMS reads in flight (the pager reads with eight
# threads; one stream of 1 MiB reads understates what the disk gives it), from the model's
# middle half (not cached): DD_STREAMS dd processes over disjoint ranges, total bytes / wall time.
DD_STREAMS=${DD_STREAMS:-8}
dd_mib=$(( DD_MIB < size_bytes / 2 / 1048576 ? DD_MIB : size_bytes / 2 / 1048576 ))
dd_mib=$(( dd_mib < DD_STREAMS ? DD_STREAMS : dd_mib ))
per_stream=$(( dd_mib / DD_STREAMS ))
t_dd=$(date +%s.%N)
for i in $(seq 0 $((DD_STREAMS - 1))); do
  dd if="$model" of=/dev/null bs=1M count="$per_stream" skip=$((size_bytes / 4 / 1048576 + i * per_stream)) \
    iflag=direct status=none &
done
wait
disk_bps=$(python3 -c "print(int($DD_STREAMS * $per_stream * 1048576 / ($(date +%s.%N) - $t_dd)))")
echo "disk: $(python3 -c "print(f'{$disk_bps / 1e9:.2f}')") GB/s O_DIRECT read, $DD_STREAMS streams ($((DD_STREAMS * per_stream)) MiB)" >&2

flags=(--ram-budget "$RAM_BUDGET" --cache-policy "$POLICY")
[ "$PREFETCH" = 1 ] && flags+=(--prefetch)
[ "$DIRECT_IO" = 1 ] && flags+=(--direct-io)

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out="$MODELS_DIR/bench-larger-than-ram-$stamp.jsonl"
: > "$out"
for r in $(seq 1 "$ROUNDS"); do
  stats="$MODELS_DIR/bench-larger-than-ram-$stamp-round$r.stats.txt"
  # Prefill and decode in separate processes, so the decode statistics count decode only.
  df_pp=$("$DF" bench -m "$model" -p "$P" -n 0 -r 1 -t "$THREADS" "${flags[@]}" --json 2>/dev/null)
  # One warm-up token, as llama-bench's (bench's longer default waits out a GPU's clock ramp,
  # which a disk-bound CPU decode does not have, and would warm the expert cache further).
  df_tg=$(DISKFORMER_BENCH_WARMUP_MS=0 "$DF" bench -m "$model" -p 0 -n "$N" -r 1 -t "$THREADS" "${flags[@]}" --stats --json 2>"$stats")
  lb_json="[]"
  if [ -n "$LB" ]; then
    lb_json=$("$LB" -m "$model" -p "$P" -n "$N" -r 1 -t "$THREADS" -o json 2>/dev/null)
  fi
  python3 - "$r" "$df_pp" "$df_tg" "$lb_json" "$stats" "$N" "$disk_bps" >> "$out" <<'PY'
import json, sys
r, pp, tg, lb = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
stats, n_gen, disk_bps = sys.argv[5], int(sys.argv[6]), float(sys.argv[7])
# The "all" row of --stats: selected hits misses evicted readMiB cpu prefetched pfhits hit%
row = next(l.split() for l in open(stats) if l.split()[:1] == ["all"])
selected, hits, read_mib, prefetched = int(row[1]), int(row[2]), float(row[5]), int(row[7])
tokens = n_gen + tg.get("tg_warmup_tokens", 1)  # the warm-up's tokens are decoded too
bytes_per_token = read_mib * 2**20 / tokens
lb_pp = next((x["avg_ts"] for x in lb if x["n_prompt"] > 0 and x["n_gen"] == 0), None)
lb_tg = next((x["avg_ts"] for x in lb if x["n_gen"] > 0 and x["n_prompt"] == 0), None)
print(json.dumps({"round": r, "df_pp": pp["pp_tok_s"], "df_tg": tg["tg_tok_s"], "lb_pp": lb_pp, "lb_tg": lb_tg,
                  "hit_rate": hits / max(selected, 1), "bytes_per_token": bytes_per_token, "prefetched": prefetched,
                  "disk_bps": disk_bps, "tg_limit": disk_bps / bytes_per_token if bytes_per_token else None,
                  "ram_budget_bytes": tg.get("ram_budget_bytes"), "size_bytes": tg["size_bytes"]}))
PY
  tail -1 "$out" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
f = lambda v: "-" if v is None else "%.2f" % v
print("round %d: pp diskformer %s llama.cpp %s; tg diskformer %s llama.cpp %s tok/s; hit rate %.1f%%, %.1f MiB/token"
      % (d["round"], f(d["df_pp"]), f(d["lb_pp"]), f(d["df_tg"]), f(d["lb_tg"]), 100 * d["hit_rate"],
         d["bytes_per_token"] / 2**20))' >&2
done

python3 - "$out" "$model" "$RAM_BUDGET" "$POLICY" "$THREADS" "$P" "$N" "$PREFETCH" "$DIRECT_IO" <<'PY'
import json, statistics, sys
path, model, budget, policy, t, p, n, prefetch, direct = sys.argv[1:10]
rows = [json.loads(l) for l in open(path)]
def ms(v):
    v = [x for x in v if x is not None]
    if not v:
        return None
    return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
def fmt(m):
    return "-" if m is None else f"{m[0]:.2f} ± {m[1]:.2f}"
print(f"{model}: {rows[0]['size_bytes'] / 2**30:.2f} GiB; diskformer --ram-budget {budget} --cache-policy {policy} "
      f"prefetch {prefetch} direct-io {direct} vs llama.cpp mmap; threads {t}, {len(rows)} alternating rounds; raw: {path}\n")
print("| test | diskformer t/s | llama.cpp t/s | diskformer / llama.cpp |")
print("|---|---|---|---|")
for test, k, size in (("pp", "pp", p), ("tg", "tg", n)):
    d, l = ms([r["df_" + k] for r in rows]), ms([r["lb_" + k] for r in rows])
    ratio = f"{d[0] / l[0]:.3f}" if d and l else "-"
    print(f"| {test}{size} | {fmt(d)} | {fmt(l)} | {ratio} |")
hr, bpt, bw = (statistics.mean(r[k] for r in rows) for k in ("hit_rate", "bytes_per_token", "disk_bps"))
print(f"\ndecode: expert-cache hit rate {100 * hr:.1f}%, {bpt / 2**20:.1f} MiB read from disk per token; "
      f"disk {bw / 1e9:.2f} GB/s (O_DIRECT, parallel reads) -> at most {bw / bpt if bpt else float('inf'):.2f} tok/s "
      f"from the disk alone at this hit rate")
tg = statistics.mean(r["df_tg"] for r in rows)
# The pager's own read rate while decoding: when it exceeds dd's, dd's figure is no bound (the
# virtio disk served the pager's 8 threads of ~1.6 MB reads faster than dd's streams).
print(f"diskformer read {bpt * tg / 1e9:.2f} GB/s from disk while decoding ({bpt / 2**20:.1f} MiB x {tg:.2f} tok/s)")
PY
