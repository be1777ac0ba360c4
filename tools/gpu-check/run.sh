#!/usr/bin/env bash
# The GPU check (issue 6): on a machine with an NVIDIA GPU, prints the NVML inventory as spindle
# sees it and runs a hardware decode (and an NVENC encode where the device has the engine) of a
# clip made here, against the same work on the CPU. A few minutes at most.
#   tools/gpu-check/run.sh            (builds the inventory example if INVENTORY_BIN is unset)
set -euo pipefail
cd "$(dirname "$0")/../.."
echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv || echo "nvidia-smi: not available"

echo "== spindle's inventory"
if [ -z "${INVENTORY_BIN:-}" ]; then
    cargo build --release -q -p spindle-gpu --example inventory
    INVENTORY_BIN=target/release/examples/inventory
fi
"$INVENTORY_BIN" | tee /tmp/gpu-check-inventory.txt

command -v ffmpeg >/dev/null || { echo "ffmpeg CLI missing: no decode check"; exit 0; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
clip="$work/clip.mp4"
ffmpeg -hide_banner -loglevel error -f lavfi -i testsrc2=size=1920x1080:rate=25:duration=20 \
    -c:v libx264 -preset ultrafast -y "$clip"

timed() { local t0 t1; t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l 2>/dev/null || python3 -c "print($t1 - $t0)"; }

echo "== decode 20 s of 1080p25 H.264"
echo -n "cpu (1 thread): "
timed ffmpeg -hide_banner -loglevel error -threads 1 -i "$clip" -f null -
echo -n "nvdec (cuda): "
if ! timed ffmpeg -hide_banner -loglevel error -hwaccel cuda -hwaccel_output_format cuda \
    -i "$clip" -f null - ; then
    echo "hardware decode failed"
fi

if grep -q "nvenc sessions [1-9]\|NVENC sessions [1-9]" /tmp/gpu-check-inventory.txt; then
    echo "== encode 720p with NVENC"
    timed ffmpeg -hide_banner -loglevel error -hwaccel cuda -i "$clip" \
        -vf scale=-2:720 -c:v h264_nvenc -f null - || echo "NVENC encode failed"
else
    echo "== no NVENC on this device: encode stays on the CPU (libx264)"
    echo -n "libx264 720p veryfast (1 thread): "
    timed ffmpeg -hide_banner -loglevel error -threads 1 -i "$clip" -vf scale=-2:720 \
        -c:v libx264 -preset veryfast -threads 1 -f null -
fi
