#!/usr/bin/env python3
"""Writes a seccomp profile for spindled's container: the container runtime's own default
profile with the three io_uring calls glommio needs allowed (io_uring_setup, io_uring_enter,
io_uring_register). The runtimes' defaults refuse them; the rest of the default stays.

    python3 deploy/container/seccomp-io-uring.py [DEFAULT_PROFILE] > deploy/container/seccomp-io-uring.json

DEFAULT_PROFILE: the runtime's default (podman on Debian: /usr/share/containers/seccomp.json,
the default; Docker's is moby's profiles/seccomp/default.json of the engine's version).
"""

import json
import sys

IO_URING = ["io_uring_setup", "io_uring_enter", "io_uring_register"]


def with_io_uring(profile):
    """`profile` with a rule allowing the io_uring calls (once, however often it is applied)."""
    rules = [r for r in profile.get("syscalls", []) if set(r.get("names", [])) != set(IO_URING)]
    rules.append({"names": IO_URING, "action": "SCMP_ACT_ALLOW"})
    return dict(profile, syscalls=rules)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/containers/seccomp.json"
    with open(path) as f:
        profile = json.load(f)
    if "defaultAction" not in profile:
        raise SystemExit(f"{path} is not a seccomp profile (no defaultAction)")
    json.dump(with_io_uring(profile), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
