#!/usr/bin/env bash
# The router's device memory on a real machine: starts `diskformer serve --models-dir`, waits for
# every model's memory estimate, prints GET /models' devices and per-device min/max, and checks
# them against the OS (nothing is faked here; the unit and HTTP tests fake the devices).
#
# Usage: tests/server/devices.sh [path/to/diskformer]
# Environment:
#   MODELS_DIR [models]   the folder served (every .gguf in it)
#   DEVICE [auto]         --device for serve (auto: the planner's choice per model)
#   CTX [4096]            -c for serve
# Checks:
#   - the `cpu` device has numeric total and free bytes, free <= total, matching /proc/meminfo's
#     MemTotal (exactly) and MemAvailable (within 5%, it moves);
#   - with nvidia-smi present: every NVIDIA discrete adapter is listed with numeric total (equal
#     to nvidia-smi's memory.total) and free (within 2% of total - memory.used);
#   - without a figure the OS gives, total/free are "unknown" (never a number);
#   - every model planned on a GPU has a gpuN entry in min and max whose model bytes are > 0 and
#     min <= max; a CPU-planned model has one cpu entry.
# On the H200 (lead): build diskformer with the gpu feature (the default), then
#   DF=target/release/diskformer MODELS_DIR=models DEVICE=auto tests/server/devices.sh "$DF"
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="${1:-$repo/target/release/diskformer}"
dir="${MODELS_DIR:-$repo/models}"
device="${DEVICE:-auto}"
ctx="${CTX:-4096}"
[ -x "$bin" ] || { echo "no diskformer binary at $bin"; exit 2; }
log="$(mktemp)"
"$bin" serve --models-dir "$dir" --port 0 --device "$device" -c "$ctx" --no-models-autoload >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  grep -q "listening on" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited"; exit 1; }
  sleep 0.1
done
url="$(grep -o 'http://[0-9.:]*' "$log" | head -1)"
[ -n "$url" ] || { cat "$log"; echo "server did not start"; exit 1; }
echo "server: $url (models from $dir, --device $device, -c $ctx)"
smi=""
if command -v nvidia-smi >/dev/null 2>&1; then
  smi="$(nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv,noheader,nounits || true)"
  echo "nvidia-smi: $(echo "$smi" | tr '\n' ';')"
fi
SMI="$smi" python3 - "$url" <<'EOF'
import json, os, sys, time, urllib.request

url = sys.argv[1]
def get():
    with urllib.request.urlopen(url + "/models", timeout=60) as r:
        return json.load(r)

t0 = time.time()
while True:
    v = get()
    states = [m["memory"]["status"] for m in v["data"]]
    if all(s in ("measured", "failed") for s in states):
        break
    if time.time() - t0 > 300:
        sys.exit(f"memory never measured: {states}")
    time.sleep(0.5)

fail = []
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        fail.append(what)

def mib(b):
    return "unknown" if not isinstance(b, int) else f"{b / 2**20:.0f} MiB"

print("devices:")
for d in v["devices"]:
    print(f"  {d['device']:6} {d['name'][:40]:40} total {mib(d['total']):>12} free {mib(d['free']):>12}  ({d['source']})")
meminfo = dict(l.split(":", 1) for l in open("/proc/meminfo").read().splitlines())
kib = lambda k: int(meminfo[k].split()[0]) * 1024
cpu = v["devices"][0]
check(cpu["device"] == "cpu" and isinstance(cpu["total"], int) and isinstance(cpu["free"], int), "cpu device listed first with numbers")
check(cpu["total"] == kib("MemTotal"), f"cpu total {cpu['total']} == MemTotal {kib('MemTotal')}")
check(abs(cpu["free"] - kib("MemAvailable")) <= 0.05 * kib("MemTotal"), f"cpu free {cpu['free']} ~ MemAvailable {kib('MemAvailable')}")
for d in v["devices"]:
    known = isinstance(d["total"], int), isinstance(d["free"], int)
    check(known[0] == known[1] and (known[0] or (d["total"] == "unknown" and d["free"] == "unknown")),
          f"{d['device']}: numbers or 'unknown', never half")
    if known[0]:
        check(d["free"] <= d["total"], f"{d['device']}: free <= total")
rows = sorted(tuple(int(x) for x in l.split(",")) for l in os.environ.get("SMI", "").splitlines() if l.strip())
nvidia = [d for d in v["devices"][1:] if "NVIDIA" in d["name"] and d["source"] == "nvidia-smi"]
if rows:
    listed = [d for d in v["devices"][1:] if "NVIDIA" in d["name"]]
    check(len(nvidia) >= 1 and len(nvidia) == min(len(rows), len(listed)), f"{len(nvidia)} NVIDIA adapters with nvidia-smi figures ({len(rows)} GPUs in nvidia-smi)")
    for d, (_, total, used) in zip(nvidia, rows):
        check(d["total"] == total << 20, f"{d['device']} total == nvidia-smi memory.total ({total} MiB)")
        check(abs(d["free"] - ((total - used) << 20)) <= 0.02 * (total << 20), f"{d['device']} free ~ total - used")
print("models:")
for m in v["data"]:
    mem = m["memory"]
    if mem["status"] != "measured":
        print(f"  {m['id']}: {mem}")
        continue
    for which in ("min", "max"):
        for d in mem[which]:
            print(f"  {m['id'][:36]:36} {which} {d['device']:5} model {mib(d['model']):>10} context {mib(d['context']):>10} compute {mib(d['compute']):>10}")
    gpus = [d for d in mem["max"] if d["device"].startswith("gpu")]
    if gpus:
        g_min = [d for d in mem["min"] if d["device"] == gpus[0]["device"]]
        check(len(g_min) == 1 and gpus[0]["model"] > 0, f"{m['id']}: GPU-planned, {gpus[0]['device']} in min and max")
        check(g_min and g_min[0]["context"] <= gpus[0]["context"], f"{m['id']}: min context <= max context on the GPU")
    else:
        check([d["device"] for d in mem["max"]] == ["cpu"], f"{m['id']}: CPU-planned, one cpu entry")
sys.exit(1 if fail else 0)
EOF
