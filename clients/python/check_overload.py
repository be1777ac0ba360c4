"""Checks the Python client against a node that refuses work for its load: the admission of a
refused submit carries the decision, its reason and the retry hint, and submit_retrying sends a
refused task again after that hint. Prints one line; exits non-zero on any surprise.

    python3 clients/python/check_overload.py HOST PORT TENANT CREDENTIAL refused KEY
        (the node is overloaded now: KEY is refused with a hint)
    python3 clients/python/check_overload.py HOST PORT TENANT CREDENTIAL retrying KEY
        (the node recovers: KEY, sent until it is taken, is accepted)
"""

import sys

from spindle_client import REJECT_PLATFORM_OVERLOADED, Client


def main():
    host, port, tenant, credential, mode, key = sys.argv[1:7]
    client = Client.connect(host, int(port), int(tenant), credential)
    task = dict(key=key, user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)
    if mode == "refused":
        a = client.submit(**task)
        assert a["decision"] == REJECT_PLATFORM_OVERLOADED, a
        assert a["retry_after_ms"] > 0, a
        assert "budget" in (a["reason"] or ""), a
        print(f"refused, retry after {a['retry_after_ms']} ms: {a['reason']}")
    elif mode == "retrying":
        a = client.submit_retrying(tries=100, **task)
        assert a["decision"] == 0, a  # ACCEPTED
        print(f"accepted task {a['task_id']}")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
