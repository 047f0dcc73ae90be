#!/usr/bin/env bash
# GPU back end check and decode bandwidth measurement, in two halves:
#
#   bench/gpu.sh build   (here, with a Rust toolchain) builds the test binaries of
#                        compute/tests/backend_ops.rs and models/tests/gpu_fixtures.rs and copies
#                        them, with a few fixture models, into .gpubin/ (ignored by git).
#   bench/gpu.sh run     (on the GPU machine, no toolchain needed) unpacks the Vulkan loader from
#                        .gl/*.deb when the system has none, then runs backend_ops (every op against
#                        the CPU reference), the fixtures on the GPU, and the perf test: decode
#                        matrix-vector GB/s for Q4_0, Q4_K, Q8_0, F16 next to a plain streaming read,
#                        with and without the 4-group unrolled loop (DISKFORMER_NO_UNROLL=1).
#
# Output: one line per op case (`matmul(q4_k, 37x512, n=5) wgpu: OK`), the fixture table, and
# `stream read ...: GB/s` / `matvec q4_0 32768x8192: ... GB/s` lines. Logs go to $OUT when set.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
bin=.gpubin

if [ "$mode" = build ]; then
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
    mkdir -p "$bin"
    for spec in "compute backend_ops wgpu" "models gpu_fixtures gpu"; do
        set -- $spec
        exe=$(cargo test -p "$1" --features "$3" --test "$2" --no-run --message-format=json 2>/dev/null \
            | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$2" | tail -1)
        # Without debug info the binaries fit the device machine's 64 MiB transfer.
        objcopy --strip-debug "$exe" "$bin/$2"
    done
    # A few fixtures (one per supported family, small variants) so the GPU machine can run the
    # model checks without ../shared.
    rm -rf "$bin/fixtures"
    for arch in llama qwen3 gemma3 mixtral; do
        src=../shared/fixtures/$arch
        [ -d "$src" ] || continue
        mkdir -p "$bin/fixtures/$arch"
        cp "$src/ref.json" "$src/config.json" "$bin/fixtures/$arch/"
        for v in f32 q8_0 q4_k_m; do
            [ -f "$src/model-$v.gguf" ] && cp "$src/model-$v.gguf" "$bin/fixtures/$arch/"
        done
    done
    cp ../shared/fixtures/README.md "$bin/fixtures/" 2>/dev/null || true
    du -sh "$bin"
    exit 0
fi

if ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
out=${OUT:-/tmp}
status=0
"$bin/backend_ops" --nocapture --test-threads 1 2>&1 | tee "$out/backend_ops.log" || status=1
DISKFORMER_NO_SUBGROUPS=1 "$bin/backend_ops" --nocapture --test-threads 1 backend_ops_match_cpu 2>&1 | tail -3 | tee "$out/backend_ops_no_subgroups.log" || status=1
if [ -d "$bin/fixtures" ]; then
    DISKFORMER_GPU_VARIANTS=all DISKFORMER_FIXTURES=$PWD/$bin/fixtures "$bin/gpu_fixtures" --nocapture 2>&1 | tee "$out/gpu_fixtures.log" || status=1
fi
"$bin/backend_ops" --nocapture --ignored perf 2>&1 | tee "$out/perf.log" || status=1
DISKFORMER_NO_UNROLL=1 "$bin/backend_ops" --nocapture --ignored perf 2>&1 | sed 's/^matvec/matvec (no unroll)/' | tee -a "$out/perf.log" || status=1
grep -E "adapter|GB/s|cases|FAIL" "$out"/backend_ops.log "$out"/perf.log || true
exit $status
