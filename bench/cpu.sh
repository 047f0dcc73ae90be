#!/usr/bin/env bash
# CPU speed of diskformer against llama.cpp (the peer, 0c1e570) on the same GGUF files, same threads.
#
# Usage: bench/cpu.sh            (from the repository root or anywhere)
# Environment (defaults in brackets):
#   THREADS [2]  ROUNDS [3]  P [128] prompt tokens  N [32] generated tokens
#   MODELS_DIR [models/]     where the real and synthetic GGUFs go
#   SYNTH_SHAPE [dense-1b]   SYNTH_TYPES ["Q4_0 Q4_K"]   REAL [1] also bench the real small models
#   PEER_BIN                 folder of llama-bench (default: built by ../shared/tools/build-llama-cpp.sh)
#   MATMUL [q8]              diskformer's --matmul
#   DF                       a prebuilt diskformer binary (default: cargo build --release here)
#
# What it does: builds diskformer (release) and, if needed, the peer; fetches the real small models
# (scripts/get-models.sh); writes a synthetic 1B-class dense model per type with `diskformer synth`;
# then, for each model, ROUNDS rounds that each run `diskformer bench -r 1` and `llama-bench -r 1`
# one after the other (alternating, so load from other processes hits both alike; each run has its
# own untimed warmup). Prints per-round figures and a table of mean ± sample std over the rounds
# with the ratio diskformer / llama.cpp. Raw results go to $MODELS_DIR/bench-cpu-<date>.jsonl.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
P=${P:-128}
N=${N:-32}
MATMUL=${MATMUL:-q8}
MODELS_DIR=${MODELS_DIR:-$repo/models}
SYNTH_SHAPE=${SYNTH_SHAPE:-dense-1b}
SYNTH_TYPES=${SYNTH_TYPES:-Q4_0 Q4_K}
REAL=${REAL:-1}
mkdir -p "$MODELS_DIR"

# 1. diskformer, release, CPU only (or a prebuilt binary named by $DF).
if [ -z "${DF:-}" ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
  cargo build --release -p cli --no-default-features >&2
  DF="$CARGO_TARGET_DIR/release/diskformer"
fi

# 2. The peer.
if [ -z "${PEER_BIN:-}" ]; then
  PEER_BIN=$("$repo/../shared/tools/build-llama-cpp.sh" | tail -1)
fi
LB="$PEER_BIN/llama-bench"
[ -x "$LB" ] || { echo "no llama-bench at $LB" >&2; exit 1; }

# 3. Models: the real small ones, then the synthetic ones.
models=()
if [ "$REAL" = 1 ]; then
  getter="$repo/scripts/get-models.sh"
  [ -x "$getter" ] || getter="$repo/../shared/tools/get-models.sh"
  while read -r _ path; do models+=("$path"); done < <("$getter" "$MODELS_DIR")
fi
for t in $SYNTH_TYPES; do
  f="$MODELS_DIR/synth-$SYNTH_SHAPE-$(echo "$t" | tr A-Z a-z).gguf"
  if [ ! -f "$f" ]; then
    "$DF" synth --shape "$SYNTH_SHAPE" --type "$t" --seed 1 --out "$f"
  fi
  models+=("$f")
done

# 3b. The peer must run on this CPU. llama.cpp 0c1e570 built with GGML_NATIVE=ON compiles its AMX
# kernels where the CPU reports AMX; on the Intel Xeon VM of the ninth session they die with SIGILL
# at their first `tilezero` (the VM does not keep the tile configuration: `sttilecfg` right after
# `ldtilecfg` reads zero rows), and `--repack 0` would also turn off its other repacked kernels.
# So when the native build dies that way, the peer is rebuilt with the same instruction sets
# (every AVX-512 extension the CPU has) and AMX left out, and that build is the one measured.
smoke=$("$LB" -m "${models[0]}" -p 16 -n 1 -r 1 -t 1 -o json >/dev/null 2>&1; echo $?)
if [ "$smoke" = 132 ]; then
  src=$(dirname "$(dirname "$PEER_BIN")")/llama.cpp-0c1e570
  noamx=$(dirname "$PEER_BIN")-noamx
  echo "the peer at $PEER_BIN dies with SIGILL (its AMX kernels): using a build without AMX at $noamx" >&2
  if [ ! -x "$noamx/bin/llama-bench" ]; then
    venv=$(dirname "$(dirname "$PEER_BIN")")/venv/bin
    [ -x "$venv/cmake" ] && PATH="$venv:$PATH"
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
    for f in avx_vnni:AVX_VNNI avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      grep -qw "${f%%:*}" /proc/cpuinfo && flags+=("-DGGML_${f#*:}=ON")
    done
    cmake -S "$(cd "$src" && pwd -P)" -B "$noamx" -G Ninja -DCMAKE_BUILD_TYPE=Release "${flags[@]}" \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_UI=OFF >&2
    cmake --build "$noamx" -j "$(nproc)" --target llama-bench >&2
  fi
  LB="$noamx/bin/llama-bench"
elif [ "$smoke" != 0 ]; then
  echo "the peer's llama-bench failed on ${models[0]} (exit $smoke)" >&2
  exit 1
fi

# 4. Alternating runs.
out="$MODELS_DIR/bench-cpu-$(date -u +%Y%m%dT%H%M%SZ).jsonl"
: > "$out"
for m in "${models[@]}"; do
  for r in $(seq 1 "$ROUNDS"); do
    # Other processes change both sides' figures (on this VM, idle and busy vCPUs behave
    # differently): the one-minute load average before each round goes into the record.
    load=$(cut -d' ' -f1 /proc/loadavg)
    df_json=$("$DF" bench -m "$m" -p "$P" -n "$N" -r 1 -t "$THREADS" --matmul "$MATMUL" --json)
    lb_json=$("$LB" -m "$m" -p "$P" -n "$N" -r 1 -t "$THREADS" -o json 2>/dev/null)
    python3 - "$m" "$r" "$df_json" "$lb_json" "$load" >> "$out" <<'EOF'
import json, sys
m, r, df, lb = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
load = float(sys.argv[5])
pp = next(x["avg_ts"] for x in lb if x["n_prompt"] > 0 and x["n_gen"] == 0)
tg = next(x["avg_ts"] for x in lb if x["n_gen"] > 0 and x["n_prompt"] == 0)
print(json.dumps({"model": m, "round": r, "df_pp": df["pp_tok_s"], "df_tg": df["tg_tok_s"], "lb_pp": pp, "lb_tg": tg,
                  "type": df["type"], "arch": df["arch"], "size_bytes": df["size_bytes"], "load_1min": load}))
EOF
    tail -1 "$out" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
name = d["model"].rsplit("/", 1)[-1]
print("round %d %s: pp diskformer %.2f llama.cpp %.2f; tg diskformer %.2f llama.cpp %.2f tok/s (load %.2f)"
      % (d["round"], name, d["df_pp"], d["lb_pp"], d["df_tg"], d["lb_tg"], d["load_1min"]))' >&2
  done
done

# 5. Summary.
python3 - "$out" "$P" "$N" "$THREADS" "$MATMUL" <<'EOF'
import json, statistics, sys
path, p, n, t, mm = sys.argv[1:6]
rows = [json.loads(l) for l in open(path)]
def ms(v):
    return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
print(f"threads {t}, diskformer --matmul {mm}, {max(r['round'] for r in rows)} alternating rounds; raw: {path}")
print(f"one-minute load average before the rounds: {min(r['load_1min'] for r in rows):.2f} to {max(r['load_1min'] for r in rows):.2f}\n")
print(f"| model | type | test | diskformer t/s | llama.cpp t/s | diskformer / llama.cpp |")
print(f"|---|---|---|---|---|---|")
for m in dict.fromkeys(r["model"] for r in rows):
    rs = [r for r in rows if r["model"] == m]
    for test, k, size in (("pp", "pp", p), ("tg", "tg", n)):
        d, l = ms([r["df_" + k] for r in rs]), ms([r["lb_" + k] for r in rs])
        name = m.rsplit("/", 1)[-1]
        print(f"| {name} | {rs[0]['type']} | {test}{size} | {d[0]:.2f} ± {d[1]:.2f} | {l[0]:.2f} ± {l[1]:.2f} | {d[0] / l[0]:.3f} |")
EOF
