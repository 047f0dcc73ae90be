#!/usr/bin/env bash
# The fused decode graph on the GPU (issue 5), on the device machine after `bench/gpu.sh build`
# (carry .gpubin and .gl): the same `diskformer` under each setting of SETTINGS, ROUNDS times
# alternately. Each line: decode tok/s and the host profile (DISKFORMER_GPU_PROFILE=1: submits,
# dispatches, encode time per dispatch, wait time).
#
#   bench/gpu_fuse.sh [model.gguf]     default: the dense-8b Q4_0 synth of bench/gpu.sh (made if absent)
#
# Default settings (space-separated environment assignments, "default" for none): the fused graph
# with int8 activations (default), the op-by-op graph (DISKFORMER_NO_FUSE=1), f32 activations
# (DISKFORMER_GPU_F32_ACT=1), workgroup memory zeroed in every kernel as WGSL requires
# (DISKFORMER_WG_ZERO=1; by default the kernels that write it before reading skip the zeroing) and
# in none (DISKFORMER_WG_ZERO=0, an experiment: the product kernels are not argued), and one submit
# per step (DISKFORMER_SUBMIT_EVERY=0). Dispatches per decode step ~ dispatches / readbacks.
#
# Settings: ROUNDS=2 P=16 N=128 SHAPE=dense-8b TYPE=Q4_0 SETTINGS="...". Logs and summary.txt go
# to $OUT (else /tmp/gpu-fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.gpubin
ROUNDS=${ROUNDS:-2}
P=${P:-16}
N=${N:-128}
SHAPE=${SHAPE:-dense-8b}
TYPE=${TYPE:-Q4_0}
out=${OUT:-/tmp/gpu-fuse}
mkdir -p "$out"
work=${WORK:-/tmp/gpu-bench-work}
mkdir -p "$work"
if ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
model=${1:-$work/synth-$SHAPE-$(echo "$TYPE" | tr A-Z a-z).gguf}
[ -f "$model" ] || "$bin/diskformer" synth --shape "$SHAPE" --type "$TYPE" --out "$model" >"$out/synth.log" 2>&1
summary=$out/summary.txt
echo "gpu_fuse.sh: $model, P=$P N=$N" | tee "$summary"
SETTINGS=${SETTINGS:-default DISKFORMER_NO_FUSE=1 DISKFORMER_GPU_F32_ACT=1 DISKFORMER_WG_ZERO=1 DISKFORMER_WG_ZERO=0 DISKFORMER_SUBMIT_EVERY=0}
for r in $(seq "$ROUNDS"); do
    for setting in $SETTINGS; do
        assign=()
        [ "$setting" = default ] || assign=("$setting")
        log=$out/bench-$(echo "$setting" | tr '=' '-')-r$r.log
        env "${assign[@]}" DISKFORMER_GPU_PROFILE=1 \
            "$bin/diskformer" bench -m "$model" --device gpu -p "$P" -n "$N" -r 1 --json >"$log" 2>&1 || true
        tg=$(grep -o '"tg_tok_s":[0-9.]*' "$log" | tail -1 | cut -d: -f2)
        echo "round $r $setting: decode ${tg:-FAILED} tok/s; $(grep 'gpu profile' "$log" | tail -1)" | tee -a "$summary"
    done
done
