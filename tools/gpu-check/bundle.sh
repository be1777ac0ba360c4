#!/usr/bin/env bash
# Builds what the GPU check runs on a GPU machine that has the NVIDIA driver but no FFmpeg and
# no Rust toolchain (the device machines lent to these sessions: Ubuntu, CUDA, nothing to
# fetch): Debian's own FFmpeg source (5.1, the version the build machines link), configured
# down to what spindle uses plus NVDEC, NVENC and CUDA, built as shared libraries; the
# gpu_check example and the hardware tests linked against it; libx264. About 13 MB in all.
#
#   tools/gpu-check/bundle.sh [DIR=.gpu]      (as root on Debian 12; ~4 min on 2 cores)
#
# then, on the GPU machine, from the repository root:
#   LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/nvidia/lib64 GPU_CHECK_BIN=.gpu/gpu_check \
#       HARDWARE_TESTS=.gpu/hardware tools/gpu-check/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
repo="$PWD"
out="$(realpath -m "${1:-.gpu}")"
work="$repo/target/gpu-ffmpeg"
prefix="$work/prefix"

if [ ! -e "$prefix/lib/libavcodec.so" ]; then
    src=/etc/apt/sources.list.d/spindle-src.sources
    [ -e "$src" ] || cat > "$src" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt-get update -qq
    apt-get install -y -qq libffmpeg-nvenc-dev libx264-dev nasm clang pkg-config >/dev/null
    mkdir -p "$work"
    (cd "$work" && apt-get source --download-only -qq ffmpeg)
    tarball=$(ls "$work"/ffmpeg_*.orig.tar.xz | head -1)
    tar -C "$work" -xf "$tarball"
    cd "$work"/ffmpeg-*/
    ./configure --prefix="$prefix" --enable-shared --disable-static --disable-programs \
        --disable-doc --enable-gpl --enable-libx264 --disable-autodetect --enable-pthreads \
        --disable-everything \
        --enable-ffnvcodec --enable-cuda --enable-cuda-llvm --enable-nvdec --enable-nvenc \
        --enable-cuvid \
        --enable-decoder=h264,hevc,vp9,mpeg4,aac,mp3,opus,rawvideo,wrapped_avframe,pcm_s16le \
        --enable-encoder=libx264,h264_nvenc,hevc_nvenc,rawvideo,wrapped_avframe,pcm_s16le \
        --enable-hwaccel=h264_nvdec,hevc_nvdec,vp9_nvdec,mpeg4_nvdec \
        --enable-parser=h264,hevc,aac,vp9,mpeg4video,opus,mpegaudio \
        --enable-demuxer=mov,matroska,h264,hevc,aac,mp3,wav,lavfi \
        --enable-muxer=mp4,mov,matroska,null,h264 \
        --enable-protocol=file,pipe \
        --enable-bsf=h264_mp4toannexb,hevc_mp4toannexb,aac_adtstoasc,extract_extradata,null \
        --enable-indev=lavfi \
        --enable-filter=testsrc,testsrc2,sine,anullsrc,buffer,buffersink,abuffer,abuffersink,scale,format,aformat,null,anull,aresample,hwdownload,hwupload,hwupload_cuda,scale_cuda,fps,setpts,trim,atrim \
        >"$work/configure.log"
    make -j"$(nproc)" >"$work/make.log" 2>&1
    make install >"$work/install.log" 2>&1
    cd "$repo"
fi

export PKG_CONFIG_PATH="$prefix/lib/pkgconfig" CARGO_TARGET_DIR="$repo/target/gpu"
cargo build --release -q -p spindle-transcode --example gpu_check
tests=$(cargo test --release -q -p spindle-transcode --test hardware --no-run --message-format json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "hardware":
        print(m["executable"])')
rm -rf "$out"
mkdir -p "$out/lib"
cp -a "$prefix"/lib/*.so.* "$out/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libx264.so.164 "$out/lib/"
cp "$CARGO_TARGET_DIR/release/examples/gpu_check" "$out/gpu_check"
cp "$tests" "$out/hardware"
strip "$out/gpu_check" "$out/hardware"
du -sh "$out"
