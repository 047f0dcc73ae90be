#!/usr/bin/env bash
# Runs the official openai and anthropic Python clients against `diskformer serve`.
# Usage: tests/server/run.sh [path/to/diskformer]
# Model: models/SmolLM2-135M-Instruct.Q4_1.gguf (scripts/get-models.sh) when present, else the
# qwen3 fixture (../shared/fixtures or tests/fixtures) with tests/server/chatml.jinja as template.
# The clients go into a venv under ${DISKFORMER_PY_VENV:-target/py-clients}.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bin="${1:-$repo/target/debug/diskformer}"
command -v python3 >/dev/null || { echo "python3 is missing (set DISKFORMER_SKIP_PY_CLIENTS=1 to skip)"; exit 2; }
venv="${DISKFORMER_PY_VENV:-$repo/target/py-clients}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || { echo "python3 -m venv failed (install python3-venv)"; exit 2; }
fi
"$venv/bin/python" -c "import openai, anthropic" 2>/dev/null ||
  "$venv/bin/python" -m pip install -q openai anthropic || { echo "pip install openai anthropic failed"; exit 2; }

args=()
model="$repo/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$model" ]; then
  model="$repo/../shared/fixtures/qwen3/model-q4_0.gguf"
  [ -f "$model" ] || model="$repo/tests/fixtures/qwen3/model-q4_0.gguf"
  args+=(--chat-template-file "$here/chatml.jinja")
fi
name="$(basename "$model" .gguf)"
echo "model: $model"
log="$(mktemp)"
"$bin" serve --model "$model" --port 0 --device cpu --no-read-ahead -c 512 --api-key test-key "${args[@]}" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  grep -q "listening on" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "server exited"; exit 1; }
  sleep 0.1
done
url="$(grep -o 'http://[0-9.:]*' "$log" | head -1)"
[ -n "$url" ] || { cat "$log"; echo "server did not start"; exit 1; }
echo "server: $url"
"$venv/bin/python" "$here/clients.py" "$url" "$name"
