#!/usr/bin/env bash
# The GPU check (issue 6): on a machine with an NVIDIA GPU, prints the NVML inventory as spindle
# sees it and where the node would place a media job, then runs spindle's own decode and
# transcode on a clip made on the spot: CPU decode against NVDEC, a 720p rendition with each,
# an NVENC rendition where the device has an encoder (else the refusal the node falls back on),
# and concurrent renditions placed by the media ledger; then the hardware tests. A few minutes.
#
#   tools/gpu-check/run.sh [seconds=20] [jobs=8]
#
# It builds what it runs unless given prebuilt binaries (a GPU machine without a toolchain):
#   GPU_CHECK_BIN   transcode/examples/gpu_check
#   HARDWARE_TESTS  the test binary of transcode/tests/hardware.rs
# with LD_LIBRARY_PATH naming the FFmpeg they were built against where the machine has none.
# docs/gpu-check.md says how the recorded run was made.
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-20}"
jobs="${2:-8}"
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) CPUs"
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current,encoder.stats.sessionCount \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
echo "== driver libraries FFmpeg and NVML load"
for lib in libcuda.so.1 libnvcuvid.so.1 libnvidia-encode.so.1 libnvidia-ml.so.1; do
    where=$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l { print $NF; exit }')
    if [ -z "$where" ]; then
        for dir in ${LD_LIBRARY_PATH//:/ } /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
            [ -e "$dir/$lib" ] && where="$dir/$lib" && break
        done
    fi
    echo "$lib: ${where:-not found}"
done

if [ -z "${GPU_CHECK_BIN:-}" ]; then
    cargo build --release -q -p spindle-transcode --example gpu_check || exit 1
    GPU_CHECK_BIN=target/release/examples/gpu_check
fi
echo
"$GPU_CHECK_BIN" "$seconds" "$jobs"
check=$?

echo
echo "== the hardware tests (transcode/tests/hardware.rs)"
if [ -z "${HARDWARE_TESTS:-}" ]; then
    cargo test --release -q -p spindle-transcode --test hardware
else
    "$HARDWARE_TESTS" --test-threads 1
fi
tests=$?
echo "== gpu check: exit $check, hardware tests: exit $tests"
[ "$check" -eq 0 ] && [ "$tests" -eq 0 ]
