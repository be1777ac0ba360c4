# spindled, spindlectl and the mock provider on Debian 12 with FFmpeg 5.1's libraries, running
# as an unprivileged user. Build from the repository's root:
#   podman build -t spindle/spindled .        (or docker build)
# Running it needs io_uring through the runtime's seccomp profile and locked memory:
# docs/container.md. compose.yaml starts it beside PostgreSQL and the mock provider.

FROM docker.io/library/rust:1-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      clang libclang-dev pkg-config \
      libavcodec-dev libavformat-dev libavutil-dev libswscale-dev libswresample-dev \
      libavfilter-dev libavdevice-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p spindled -p spindle-providers \
      --bin spindled --bin spindlectl --bin spindle-mock-provider \
 && install -D -t /out target/release/spindled target/release/spindlectl \
      target/release/spindle-mock-provider

FROM docker.io/library/debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      ca-certificates libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4 \
      libavfilter8 libavdevice59 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /var/lib/spindle spindle
COPY --from=build /out/ /usr/local/bin/
USER 10001
WORKDIR /var/lib/spindle
# The client protocol and the HTTP port (probes, /metrics, admin, provider callbacks).
EXPOSE 7070 7072
# Configured by SPINDLE_* variables (every key: docs/operations.md) or a file passed as
# `--config`; the container stops on SIGTERM after draining (drain_ms).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/spindled"]
