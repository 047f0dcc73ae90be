#!/usr/bin/env bash
# The GPU expert tier on a mixture-of-experts model larger than its GPU budget: diskformer with
# --gpu-budget (dense weights, KV cache, scratch and a pool of expert slots in GPU memory, misses
# uploaded through staging buffers or computed on the CPU) against llama.cpp with its experts
# kept on the CPU (-ot exps=CPU), same file; prefill and decode tok/s, the GPU pool's hit rate,
# bytes uploaded per decoded token, and the decode limit those bytes and the measured upload
# bandwidth allow.
#
# Two halves:
#   bench/paged.sh build   (here, with a Rust toolchain) builds diskformer --release with the gpu
#                          feature into $BIN (default .gpubin/paged, ignored by git), stripped.
#   bench/paged.sh [run]   (on the GPU machine, no toolchain, no network) unpacks the Vulkan loader
#                          from .gl/*.deb when the system has none, synthesizes the model on the
#                          local disk (`diskformer synth`), runs the benchmark, prints the table.
#
# Environment (defaults in brackets):
#   BIN [.gpubin/paged]     folder holding `diskformer`; `llama-bench` and its .so files beside it
#                           (or in PEER_BIN) are the peer, when present
#   SHAPE [qwen3-30b-a3b]   TYPE [Q4_K]   PARAMS [] (`synth --params`, e.g. small dims)  SKEW [0]
#   GPU_BUDGET [4G]  MISS [] (--moe-miss: upload|cpu|auto|host; host = misses read by the GPU
#                           from a copy of every expert in host memory, no wait per layer; empty:
#                           diskformer's default, host where that copy fits RAM, else auto)
#   POLICY [lfu] (--cache-policy)
#   RAM_BUDGET []           empty: misses read from the memory map (the page cache is the host
#                           tier); a size: through the pager's RAM cache of that size
#   P [512]  N [128]  REPS [2]  THREADS [0: every core]
#   ROUNDS [1]              decode rounds: after the first (which gives the statistics), ROUNDS-1
#                           more of diskformer and llama.cpp alternating, so that a lease whose
#                           speed drifts moves both; the table's decode figures are the rounds' means
#   MODELS_DIR [/tmp/diskformer-paged]   where the model is written (needs ~18 GB for the default)
#   PEER [1]  PEER_BIN [$BIN, else bench/gpu.sh's CUDA build in $WORK/peer/build-cuda/bin]
#   LB_FLAGS [-ngl 99 -ot exps=CPU]
#   OUT [$OUT or /tmp]      raw results: paged-<date>.jsonl and the --stats tables
#   RESIDENT [0]            1: also every expert on the GPU (`--device gpu`, no budget): the tier's
#                           ceiling on a GPU that holds the model (routing ids never leave the GPU)
#
# Example on a small model (proves the script on lavapipe in a minute; the budget holds the back
# end's fixed ~81 MiB, allocator block ends and one weight-upload piece, beside the model):
#   PARAMS=n_layer=4,n_embd=256,n_expert=32,n_expert_used=4,n_ff_exp=256,n_ff=512 VOCAB=2048 \
#   GPU_BUDGET=104M P=16 N=8 REPS=1 PEER=0 bench/paged.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
mode=${1:-run}
BIN=${BIN:-$repo/.gpubin/paged}

if [ "$mode" = build ]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$repo/target}
  cargo build --release -p cli --features gpu >&2
  mkdir -p "$BIN"
  objcopy --strip-debug "$CARGO_TARGET_DIR/release/diskformer" "$BIN/diskformer"
  du -sh "$BIN"
  exit 0
fi

SHAPE=${SHAPE:-qwen3-30b-a3b}
TYPE=${TYPE:-Q4_K}
PARAMS=${PARAMS:-}
VOCAB=${VOCAB:-}
SKEW=${SKEW:-0}
GPU_BUDGET=${GPU_BUDGET:-4G}
MISS=${MISS:-}
POLICY=${POLICY:-lfu}
RAM_BUDGET=${RAM_BUDGET:-}
P=${P:-512}
N=${N:-128}
REPS=${REPS:-2}
ROUNDS=${ROUNDS:-1}
THREADS=${THREADS:-0}
MODELS_DIR=${MODELS_DIR:-/tmp/diskformer-paged}
PEER=${PEER:-1}
# The peer: llama-bench in PEER_BIN, else beside diskformer, else the CUDA build bench/gpu.sh made
# in this machine's run (its WORK folder).
if [ -z "${PEER_BIN:-}" ]; then
  PEER_BIN=$BIN
  gpu_sh_cuda=${WORK:-/tmp/gpu-bench-work}/peer/build-cuda/bin
  [ ! -x "$PEER_BIN/llama-bench" ] && [ -x "$gpu_sh_cuda/llama-bench" ] && PEER_BIN=$gpu_sh_cuda
fi
LB_FLAGS=${LB_FLAGS:--ngl 99 -ot exps=CPU}
RESIDENT=${RESIDENT:-0}
out_dir=${OUT:-/tmp}
DF="$BIN/diskformer"
[ -x "$DF" ] || { echo "no diskformer at $DF (run bench/paged.sh build first, or set BIN)" >&2; exit 1; }

# The Vulkan loader and the NVIDIA ICD, as bench/gpu.sh finds them on the device machine.
if ! ldconfig -p | grep -q libvulkan.so.1; then
  for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
  ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi

mkdir -p "$MODELS_DIR" "$out_dir"
tag=""
[ -n "$PARAMS" ] && tag="-$(echo "$PARAMS" | tr ',=' '-_')"
[ -n "$VOCAB" ] && tag="$tag-v$VOCAB"
model="$MODELS_DIR/synth-$SHAPE$tag-$(echo "$TYPE" | tr A-Z a-z)-skew$SKEW.gguf"
if [ ! -f "$model" ]; then
  vocab=()
  [ -n "$VOCAB" ] && vocab=(--vocab "$VOCAB")
  t0=$(date +%s.%N)
  "$DF" synth --shape "$SHAPE" --params "$PARAMS" --type "$TYPE" --seed 1 --routing-skew "$SKEW" "${vocab[@]}" \
    -t "$THREADS" --out "$model.tmp" >&2
  mv "$model.tmp" "$model"
  echo "synth: $(stat -c %s "$model") B in $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s" >&2
fi
size_bytes=$(stat -c %s "$model")

flags=(--gpu-budget "$GPU_BUDGET" --cache-policy "$POLICY" -t "$THREADS" -r "$REPS")
stamp=$(date -u +%Y%m%dT%H%M%SZ)
# The GPU's clock through the whole run (nvidia-smi, when there is one): the driver lowers it
# while the GPU idles and takes ~0.3 s of load to raise it (docs/PAGING.md), which each engine's
# first repetition may or may not pay.
clock_pid=""
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu --format=csv,noheader -lms 100 \
    >"$out_dir/paged-$stamp-clocks.csv" 2>/dev/null &
  clock_pid=$!
fi
[ -n "$MISS" ] && flags+=(--moe-miss "$MISS")
[ -n "$RAM_BUDGET" ] && flags+=(--ram-budget "$RAM_BUDGET")
raw="$out_dir/paged-$stamp.jsonl"
pp_stats="$out_dir/paged-$stamp-pp.stats.txt"
tg_stats="$out_dir/paged-$stamp-tg.stats.txt"
# Prefill and decode in separate processes, so the decode statistics count decode only.
df_pp='{"pp_tok_s": null}'
if [ "$P" -gt 0 ]; then
  df_pp=$("$DF" bench -m "$model" -p "$P" -n 0 "${flags[@]}" --stats --json 2>"$pp_stats") \
    || { cat "$pp_stats" >&2; exit 1; }
fi
# GPU memory (nvidia-smi, when there is one), so that the budget check separates the driver's own
# context from our buffers: in use before any model loads (idle), the peak of a process holding a
# model of a few MB (the driver's context plus the back end's fixed buffers), and the peak while
# decoding (the host tier must not be in it).
smi_log="$out_dir/paged-$stamp-smi.txt"
smi_ctx_log="$out_dir/paged-$stamp-smi-context.txt"
smi_pid=""
smi_idle=""
if command -v nvidia-smi >/dev/null 2>&1; then
  smi_idle=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  probe_model="$MODELS_DIR/synth-context-probe.gguf"
  if [ ! -f "$probe_model" ]; then
    "$DF" synth --shape qwen3-30b-a3b --type Q4_K --seed 1 --vocab 2048 \
      --params n_layer=1,n_embd=256,n_expert=32,n_expert_used=4,n_ff_exp=256,n_ff=512 --out "$probe_model" >&2
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 >"$smi_ctx_log" 2>/dev/null &
  ctx_pid=$!
  # Held 0.4 s after its warm-up with every buffer made, so the 50 ms samples catch the peak: a
  # probe that ran straight through was sometimes sampled before its fixed buffers (66 MiB
  # against 170: the decode then read 0.1 GB over the budget that it was not).
  DISKFORMER_BENCH_PAUSE_MS=400 "$DF" bench -m "$probe_model" --device gpu -p 0 -n 16 -r 1 >/dev/null 2>&1 \
    || echo "note: the context probe failed" >&2
  kill "$ctx_pid" 2>/dev/null || true
  echo "GPU memory: ${smi_idle} MiB in use before any model loads; the context probe's model: $(stat -c %s "$probe_model") B" >&2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$smi_log" 2>/dev/null &
  smi_pid=$!
fi
df_tg=$("$DF" bench -m "$model" -p 0 -n "$N" "${flags[@]}" --stats --json 2>"$tg_stats") \
  || { cat "$tg_stats" >&2; [ -n "$smi_pid" ] && kill "$smi_pid"; exit 1; }
[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null || true
df_res='{}'
res_err="$out_dir/paged-$stamp-resident.err"
if [ "$RESIDENT" = 1 ]; then
  # Decode and prefill in separate processes, as above.
  res_tg=$("$DF" bench -m "$model" --device gpu -p 0 -n "$N" -t "$THREADS" -r "$REPS" --json \
    2>"$res_err") || { tail -5 "$res_err" >&2; res_tg='{}'; }
  res_pp='{}'
  if [ "$P" -gt 0 ]; then
    res_pp=$("$DF" bench -m "$model" --device gpu -p "$P" -n 0 -t "$THREADS" -r "$REPS" --json \
      2>>"$res_err.pp") || { tail -5 "$res_err.pp" >&2; res_pp='{}'; }
  fi
  df_res=$(python3 -c 'import json,sys; a,b=json.loads(sys.argv[1]),json.loads(sys.argv[2]); print(json.dumps({"pp_tok_s": b.get("pp_tok_s"), "tg_tok_s": a.get("tg_tok_s")}))' "$res_tg" "$res_pp")
fi
# The machine's bandwidths, measured now for the limits below: the GPU's reads of host memory
# (the link that carries every miss) and the CPU's reads of RAM.
probe_json=$("$DF" probe --json 2>/dev/null) || probe_json='{}'
lb_json="[]"
LB="$PEER_BIN/llama-bench"
if [ "$PEER" = 1 ] && [ -f "$LB" ] && [ -x "$LB" ]; then
  # shellcheck disable=SC2086 # LB_FLAGS is a list of flags
  lb_json=$(LD_LIBRARY_PATH="$PEER_BIN:${LD_LIBRARY_PATH:-}" "$LB" -m "$model" -p "$P" -n "$N" -r "$REPS" \
    $LB_FLAGS -o json 2>"$out_dir/paged-$stamp-llama-bench.err") || { tail -5 "$out_dir/paged-$stamp-llama-bench.err" >&2; lb_json="[]"; }
elif [ "$PEER" = 1 ]; then
  echo "note: no llama-bench at $LB: diskformer only" >&2
fi
# More decode rounds, the two engines alternating (decode only: prefill varies less).
rounds_json="[]"
for ((round = 2; round <= ROUNDS; round++)); do
  df_r=$("$DF" bench -m "$model" -p 0 -n "$N" "${flags[@]}" --json 2>>"$out_dir/paged-$stamp-rounds.err") || df_r='{}'
  lb_r="[]"
  if [ "$lb_json" != "[]" ]; then
    # shellcheck disable=SC2086 # LB_FLAGS is a list of flags
    lb_r=$(LD_LIBRARY_PATH="$PEER_BIN:${LD_LIBRARY_PATH:-}" "$LB" -m "$model" -p 0 -n "$N" -r "$REPS" \
      $LB_FLAGS -o json 2>>"$out_dir/paged-$stamp-rounds.err") || lb_r="[]"
  fi
  rounds_json=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); d=json.loads(sys.argv[2]); l=json.loads(sys.argv[3])
t = next((x for x in l if x["n_gen"] > 0), {})
r.append({"df_tg": d.get("tg_tok_s"), "lb_tg": t.get("avg_ts"), "df_tg_reps": d.get("tg_samples"), "lb_tg_reps": t.get("samples_ts")})
print(json.dumps(r))' \
    "$rounds_json" "$df_r" "$lb_r")
  echo "decode round $round: $rounds_json" >&2
done

[ -n "$clock_pid" ] && kill "$clock_pid" 2>/dev/null || true

python3 - "$df_pp" "$df_tg" "$lb_json" "$tg_stats" "$N" "$REPS" "$model" "$size_bytes" "$GPU_BUDGET" "${MISS:-default}" \
  "$LB_FLAGS" "$raw" "$df_res" "$smi_log" "$smi_idle" "$smi_ctx_log" "$tg_stats" "$probe_json" "$rounds_json" <<'PY'
import json, re, sys
pp, tg, lb = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
res = json.loads(sys.argv[13])
stats_path, n_gen, reps, model, size_bytes = sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], int(sys.argv[8])
budget, miss, lb_flags, raw = sys.argv[9], sys.argv[10], sys.argv[11], sys.argv[12]
def smi_samples(path):
    try:
        return [int(l.split()[0]) for l in open(path) if l.strip()[:1].isdigit()]
    except OSError:
        return []
smi, smi_ctx = smi_samples(sys.argv[14]), smi_samples(sys.argv[16])
smi_idle = int(sys.argv[15]) if sys.argv[15].strip().isdigit() else None
lines = open(stats_path).read().splitlines()
# The GPU tier's table: its header line, then rows up to "all":
# layer selected hits misses uploads uploadMiB cpu evicted host-reads hit%
head = next(i for i, l in enumerate(lines) if l.startswith("GPU expert tier:"))
upload_bps = float(re.search(r"upload ([0-9.]+) GB/s measured", lines[head]).group(1)) * 1e9
row = next(l.split() for l in lines[head:] if l.split()[:1] == ["all"])
selected, hits, misses, uploads, up_mib, cpu = int(row[1]), int(row[2]), int(row[3]), int(row[4]), float(row[5]), int(row[6])
host_reads = int(row[8]) if len(row) > 9 else 0
evicted = int(row[7])  # uploads that replaced a pooled expert; the others filled empty slots once
profile = next((l for l in lines if l.startswith("tier host time per step")), "")
placement = next((l for l in lines if l.startswith("GPU placement:")), "")
# The warm-up's tokens are decoded (and counted in the stats) too: one, or as many as bench's
# warm-up time took (its JSON says how many).
tokens = tg.get("tg_warmup_tokens", 1) + reps * n_gen
slot = re.search(r"GPU expert tier: \d+ slots of ([0-9.]+) MiB", lines[head])
expert_bytes = float(slot.group(1)) * 2**20 if slot else None
probe = json.loads(sys.argv[18]) if sys.argv[18].strip() else {}
gpus = probe.get("gpus") or [{}]
link_bps = gpus[0].get("host_read_bytes_per_s")
ram_bps = (probe.get("memory") or {}).get("bandwidth_bytes_per_s")
bytes_per_token = up_mib * 2**20 / tokens
lb_pp = next((x["avg_ts"] for x in lb if x["n_prompt"] > 0 and x["n_gen"] == 0), None)
lb_tg_test = next((x for x in lb if x["n_gen"] > 0 and x["n_prompt"] == 0), {})
lb_tg = lb_tg_test.get("avg_ts")
# Decode rounds: the first run of each engine, then the alternating ones; the means go in the table.
# Each round keeps its repetitions too: a first repetition slower than the rest is a start-up cost
# (the pool's warm-up, the GPU's clocks) rather than the decode's pace.
rounds = [{"df_tg": tg["tg_tok_s"], "lb_tg": lb_tg, "df_tg_reps": tg.get("tg_samples"),
           "lb_tg_reps": lb_tg_test.get("samples_ts")}] + json.loads(sys.argv[19])
mean = lambda vs: sum(vs) / len(vs) if vs else None
df_tg_mean = mean([r["df_tg"] for r in rounds if r["df_tg"]])
lb_tg_mean = mean([r["lb_tg"] for r in rounds if r["lb_tg"]])
rec = {"model": model, "size_bytes": size_bytes, "gpu_budget": budget, "moe_miss": miss,
       "df_pp": pp.get("pp_tok_s"), "df_tg": df_tg_mean, "lb_pp": lb_pp, "lb_tg": lb_tg_mean, "lb_flags": lb_flags,
       "tg_rounds": rounds,
       "hit_rate": hits / max(selected, 1), "uploads_per_token": uploads / tokens, "cpu_experts_per_token": cpu / tokens,
       "replacements_per_token": evicted / tokens, "fill_uploads": uploads - evicted,
       "bytes_uploaded_per_token": bytes_per_token, "upload_bps": upload_bps,
       "tg_limit_upload": upload_bps / bytes_per_token if bytes_per_token else None, "placement": placement,
       "resident_pp": res.get("pp_tok_s"), "resident_tg": res.get("tg_tok_s"),
       "host_reads_per_token": host_reads / tokens, "tier_profile": profile,
       "expert_bytes": expert_bytes, "link_bps": link_bps, "ram_bps": ram_bps,
       "gpu_mem_used_mib_peak": max(smi) if smi else None, "gpu_mem_used_mib_idle": smi_idle,
       "gpu_mem_used_mib_context_peak": max(smi_ctx) if smi_ctx else None,
       "moe_miss_choice": next((l for l in open(sys.argv[17]).read().splitlines() if l.startswith("expert misses:")), "")}
with open(raw, "a") as f:
    f.write(json.dumps(rec) + "\n")
fmt = lambda v: "-" if v is None else f"{v:.2f}"
ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"
print(f"{model}: {size_bytes / 2**30:.2f} GiB; diskformer --gpu-budget {budget} --moe-miss {miss} "
      f"vs llama.cpp {lb_flags}; raw: {raw}")
print(placement)
print()
print("| test | diskformer t/s | llama.cpp t/s | diskformer / llama.cpp |")
print("|---|---|---|---|")
print(f"| pp | {fmt(rec['df_pp'])} | {fmt(lb_pp)} | {ratio(rec['df_pp'], lb_pp)} |")
print(f"| tg{f' (mean of {len(rounds)} alternating rounds)' if len(rounds) > 1 else ''} | {fmt(rec['df_tg'])} | "
      f"{fmt(lb_tg_mean)} | {ratio(rec['df_tg'], lb_tg_mean)} |")
lb_tg = lb_tg_mean
if res:
    print(f"| pp, every expert on the GPU | {fmt(res.get('pp_tok_s'))} | {fmt(lb_pp)} | {ratio(res.get('pp_tok_s'), lb_pp)} |")
    print(f"| tg, every expert on the GPU | {fmt(res.get('tg_tok_s'))} | {fmt(lb_tg)} | {ratio(res.get('tg_tok_s'), lb_tg)} |")
limit = rec["tg_limit_upload"]
print(f"\ndecode: GPU pool hit rate {100 * rec['hit_rate']:.1f}%, {rec['uploads_per_token']:.1f} experts uploaded "
      f"({uploads} in all: {uploads - evicted} into empty slots, {evicted} replacing a pooled expert, "
      f"{evicted / tokens:.1f} per token) and "
      f"{rec['cpu_experts_per_token']:.1f} computed on the CPU per token, {bytes_per_token / 2**20:.1f} MiB uploaded "
      f"per token; upload {upload_bps / 1e9:.2f} GB/s (measured by the tier) -> at most "
      f"{'inf' if limit is None else f'{limit:.1f}'} tok/s from uploads alone at this hit rate")
if len(rounds) > 1:
    print("decode rounds (diskformer, llama.cpp, ratio): " + "; ".join(
        f"{fmt(r['df_tg'])}, {fmt(r['lb_tg'])}, {ratio(r['df_tg'], r['lb_tg'])}" for r in rounds))
reps_of = lambda r, k: " ".join(fmt(v) for v in r.get(k) or []) or "-"
print("decode repetitions per round (diskformer | llama.cpp): " + "; ".join(
    f"{reps_of(r, 'df_tg_reps')} | {reps_of(r, 'lb_tg_reps')}" for r in rounds))
if host_reads:
    print(f"misses read by the GPU from host memory: {host_reads / tokens:.1f} experts per token")
if expert_bytes and link_bps and ram_bps:
    # Limits from this run's own measurements (probe, the tier's counts): bytes per token over a
    # rate, nothing else counted (the dense layers, the attention, every latency are extra).
    # Every miss is read from host memory once, by the GPU over the link or by the CPU from RAM;
    # the refills cross the link too. The peer's CPU reads every selected expert from RAM.
    miss_b = (host_reads + cpu) / tokens * expert_bytes
    link_b = host_reads / tokens * expert_bytes + bytes_per_token
    peer_b = selected / tokens * expert_bytes
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    print(f"limits from this run's bandwidths (probe: the GPU reads host memory at {link_bps / 1e9:.1f} GB/s, the CPU RAM "
          f"at {ram_bps / 1e9:.1f} GB/s), expert bytes per token over a rate, all else free:")
    print(f"  diskformer, misses over the link: {gib(link_b)} per token (misses {gib(miss_b)}, refills "
          f"{gib(bytes_per_token)}) -> at most {link_bps / link_b:.1f} tok/s" if link_b else "  no bytes over the link")
    if miss_b:
        # Both read the same RAM, and so do the refills' copies: the RAM's rate bounds them together.
        print(f"  diskformer, misses shared by the link and the CPU and the refills, all read from the same RAM: "
              f"{gib(miss_b + bytes_per_token)} per token -> at most {ram_bps / (miss_b + bytes_per_token):.1f} tok/s")
    print(f"  llama.cpp, every selected expert from RAM by the CPU: {gib(peer_b)} per token -> at most "
          f"{ram_bps / peer_b:.1f} tok/s" + (f" (measured {lb_tg:.1f}; 2x that is {2 * lb_tg:.1f})" if lb_tg else ""))
if profile:
    print(profile)
if rec["moe_miss_choice"]:
    print(rec["moe_miss_choice"])
if smi:
    print(f"GPU memory in use while decoding (nvidia-smi): peak {max(smi)} MiB")
if smi and smi_ctx and smi_idle is not None:
    # The context probe holds a few MB of model: its peak above idle is the driver's context and
    # the back end's fixed buffers, which no budget counts.
    ctx, ours = max(smi_ctx) - smi_idle, max(smi) - max(smi_ctx)
    print(f"GPU memory: idle {smi_idle} MiB, driver context (a process with a tiny model) {ctx} MiB, "
          f"decode peak above that {ours} MiB = {ours * 2**20 / 1e9:.2f} GB against --gpu-budget {budget}")
PY
