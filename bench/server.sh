#!/usr/bin/env bash
# Serving throughput of `diskformer serve` against llama-server (llama.cpp 0c1e570) on the same GGUF,
# same CPU threads, same context per slot and the same number of parallel slots.
#
# Usage: bench/server.sh            (from the repository root or anywhere)
# Environment (defaults in brackets):
#   MODEL [models/SmolLM2-135M-Instruct.Q4_1.gguf]   fetched by scripts/get-models.sh when absent
#   THREADS [2]        CPU threads of each server (diskformer --threads, llama-server -t/-tb)
#   CTX [1024]         context per slot (diskformer -c is per session; llama-server gets -c CTX*NP
#                      with --no-kv-unified, so each of its NP slots also holds CTX)
#   CLIENTS ["1 4 16"] concurrency levels, each run on freshly started servers
#   SLOTS [match]      parallel slots per level: "match" gives NP = clients, a number fixes it
#                      (diskformer --parallel NP, llama-server -np NP)
#   REQUESTS [0]       requests per level and engine (0: 4 x clients, at least 8)
#   MAX_TOKENS [64]    max_tokens of every request (temperature 0: greedy on both)
#   DF                 a prebuilt diskformer binary (default: cargo build --release -p cli, CPU only)
#   PEER_BIN           folder holding llama-server (default ~/.cache/diskformer-peer/build-cpu/bin,
#                      built by ../shared/tools/build-llama-cpp.sh when missing)
#   OUT [models/bench-server-<date>.jsonl]  raw results
#
# What it does: for each concurrency level, starts one engine, sends one untimed warm-up request,
# then REQUESTS streaming chat requests from CLIENTS concurrent clients (each client sends its next
# request when the previous one ends), stops the engine, and does the same with the other engine;
# the engine that goes first alternates between levels so drift in machine load hits both alike.
# Every request is a distinct short prompt (so prompt caches help both alike, only in the shared
# chat-template prefix) with stream_options.include_usage; generated tokens are the server's own
# usage.completion_tokens. Reported per level and engine: tokens/s (generated tokens over the
# level's wall time), requests/s, mean time to first content token, mean request latency; and the
# ratios diskformer / llama-server. Greedy decoding may end a request early on an end-of-text token;
# tokens/s counts the tokens actually generated.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
MODEL=${MODEL:-$repo/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
CTX=${CTX:-1024}
CLIENTS=${CLIENTS:-1 4 16}
SLOTS=${SLOTS:-match}
REQUESTS=${REQUESTS:-0}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT=${OUT:-$repo/models/bench-server-$(date -u +%Y%m%dT%H%M%SZ).jsonl}

# 1. diskformer, release, CPU only (or a prebuilt binary named by $DF).
if [ -z "${DF:-}" ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
  cargo build --release -p cli --no-default-features >&2
  DF="$CARGO_TARGET_DIR/release/diskformer"
fi

# 2. The peer.
if [ -z "${PEER_BIN:-}" ]; then
  PEER_BIN=$HOME/.cache/diskformer-peer/build-cpu/bin
  [ -x "$PEER_BIN/llama-server" ] || PEER_BIN=$("$repo/../shared/tools/build-llama-cpp.sh" | tail -1)
fi
LS="$PEER_BIN/llama-server"
[ -x "$LS" ] || { echo "no llama-server at $LS" >&2; exit 1; }

# 3. The model.
if [ ! -f "$MODEL" ]; then
  getter="$repo/scripts/get-models.sh"
  [ -x "$getter" ] || getter="$repo/../shared/tools/get-models.sh"
  "$getter" "$(dirname "$MODEL")" >/dev/null
fi
[ -f "$MODEL" ] || { echo "no model at $MODEL" >&2; exit 1; }
mkdir -p "$(dirname "$OUT")"
: > "$OUT"

client=$(mktemp --suffix=.py)
logs=$(mktemp -d)
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$client" "$logs"
}
trap cleanup EXIT

# The load generator: standard library only (http.client over loopback, one thread per client).
cat > "$client" <<'EOF'
import http.client, json, sys, threading, time

url, engine, model, (clients, requests, max_tokens, slots) = sys.argv[1], sys.argv[2], sys.argv[3], map(int, sys.argv[4:8])
host, port = url.removeprefix("http://").split(":")
TOPICS = ["a lighthouse", "a lost key", "the first snow", "a robot gardener", "an old map", "a quiet train",
          "a clockmaker", "the northern lights", "a paper boat", "a city at dawn", "a violin", "a desert well"]

def one(i):
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"Story {i}: write a long story about {TOPICS[i % len(TOPICS)]}."}]})
    c = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{engine}: status {r.status}: {r.read()[:500]!r}")
    ttft, tokens, done = None, None, False
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for ch in chunk.get("choices", []):
            if ttft is None and ch.get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
    c.close()
    if not done or tokens is None:
        raise RuntimeError(f"{engine}: request {i} ended without usage or [DONE]")
    return tokens, ttft if ttft is not None else time.perf_counter() - t0, time.perf_counter() - t0

one(10_000)  # warm-up, untimed
results, errors, lock, nxt = [], [], threading.Lock(), iter(range(requests))
def worker():
    while True:
        with lock:
            i = next(nxt, None)
        if i is None:
            return
        try:
            res = one(i)
        except Exception as e:  # reported below, fails the run
            with lock:
                errors.append(repr(e))
            return
        with lock:
            results.append(res)
t0 = time.perf_counter()
threads = [threading.Thread(target=worker) for _ in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
wall = time.perf_counter() - t0
if errors:
    sys.exit(f"{len(errors)} requests failed: {errors[:3]}")
tokens = sum(r[0] for r in results)
print(json.dumps({"engine": engine, "clients": clients, "slots": slots, "requests": len(results), "tokens": tokens,
                  "wall_s": wall, "tok_s": tokens / wall, "req_s": len(results) / wall,
                  "ttft_ms": 1e3 * sum(r[1] for r in results) / len(results),
                  "latency_ms": 1e3 * sum(r[2] for r in results) / len(results)}))
EOF

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Starts an engine with NP slots on a free port; sets server_pid and url.
start_engine() {
  local engine=$1 np=$2 clients=$3 port
  port=$(free_port)
  url="http://127.0.0.1:$port"
  if [ "$engine" = diskformer ]; then
    "$DF" serve --model "$MODEL" --host 127.0.0.1 --port "$port" --device cpu --threads "$THREADS" \
      -c "$CTX" --parallel "$np" --queue $((clients + np + 1)) >"$logs/$engine.log" 2>&1 &
  else
    "$LS" -m "$MODEL" --host 127.0.0.1 --port "$port" -t "$THREADS" -tb "$THREADS" \
      -c $((CTX * np)) -np "$np" --no-kv-unified --no-webui >"$logs/$engine.log" 2>&1 &
  fi
  server_pid=$!
  for _ in $(seq 1 600); do
    if curl -sf "$url/health" >/dev/null 2>&1; then return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { cat "$logs/$engine.log" >&2; echo "$engine exited" >&2; exit 1; }
    sleep 0.2
  done
  cat "$logs/$engine.log" >&2
  echo "$engine did not become healthy" >&2
  exit 1
}

stop_engine() {
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}

echo "model: $MODEL; threads $THREADS; context per slot $CTX; max_tokens $MAX_TOKENS; slots $SLOTS" >&2
echo "diskformer: $DF ($(git -C "$repo" rev-parse --short HEAD)); llama-server: $LS" >&2
level=0
for c in $CLIENTS; do
  np=$SLOTS
  [ "$np" = match ] && np=$c
  n=$REQUESTS
  [ "$n" -gt 0 ] || n=$((c * 4 > 8 ? c * 4 : 8))
  if [ $((level % 2)) -eq 0 ]; then order="diskformer llama-server"; else order="llama-server diskformer"; fi
  for engine in $order; do
    start_engine "$engine" "$np" "$c"
    python3 "$client" "$url" "$engine" "$(basename "$MODEL" .gguf)" "$c" "$n" "$MAX_TOKENS" "$np" | tee -a "$OUT" >&2
    stop_engine
  done
  level=$((level + 1))
done

python3 - "$OUT" "$MODEL" "$THREADS" "$CTX" "$MAX_TOKENS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"\nmodel {sys.argv[2].rsplit('/', 1)[-1]}, {sys.argv[3]} threads, context {sys.argv[4]} per slot, "
      f"max_tokens {sys.argv[5]}, temperature 0\n")
print("| clients | slots | engine | requests | tokens | tokens/s | requests/s | TTFT ms | latency ms |")
print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
by = {}
for r in rows:
    by[(r["clients"], r["engine"])] = r
    print(f"| {r['clients']} | {r['slots']} | {r['engine']} | {r['requests']} | {r['tokens']} | {r['tok_s']:.1f} | "
          f"{r['req_s']:.2f} | {r['ttft_ms']:.0f} | {r['latency_ms']:.0f} |")
print("\n| clients | tokens/s diskformer / llama-server | requests/s diskformer / llama-server |")
print("|---:|---:|---:|")
for c in sorted({r["clients"] for r in rows}):
    d, l = by.get((c, "diskformer")), by.get((c, "llama-server"))
    if d and l:
        print(f"| {c} | {d['tok_s'] / l['tok_s']:.2f} | {d['req_s'] / l['req_s']:.2f} |")
print(f"\nraw: {sys.argv[1]}")
EOF
