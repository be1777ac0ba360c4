"""Checks the Python SDK against a node that refuses work for its load: the admission of a
refused submit carries the decision, its reason and the retry hint, and submit_retrying sends a
refused task again after that hint — through the blocking Client and the AsyncClient alike.
Prints one line per client; exits non-zero on any surprise.

    python3 clients/python/tests/check_overload.py HOST PORT TENANT CREDENTIAL refused KEY
        (the node is overloaded now: KEY is refused with a hint)
    python3 clients/python/tests/check_overload.py HOST PORT TENANT CREDENTIAL retrying KEY
        (the node recovers: KEY, sent until it is taken, is accepted)
"""

import asyncio
import sys

from spindle_client import ACCEPTED, REJECT_PLATFORM_OVERLOADED, AsyncClient, Client


def task(key):
    return dict(key=key, user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)


def check(mode, a, client_name):
    if mode == "refused":
        assert a["decision"] == REJECT_PLATFORM_OVERLOADED, a
        assert a["retry_after_ms"] > 0, a
        # Why, in words (the gate's budget, or the stalled store's own refusal).
        assert a["reason"], a
        print(f"{client_name}: refused, retry after {a['retry_after_ms']} ms: {a['reason']}")
    else:
        assert a["decision"] == ACCEPTED, a
        print(f"{client_name}: accepted task {a['task_id']}")


async def with_asyncio(host, port, tenant, credential, mode, key):
    async with await AsyncClient.connect(host, port, tenant, credential) as client:
        if mode == "refused":
            return await client.submit(**task(key))
        return await client.submit_retrying(tries=100, **task(key))


def main():
    host, port, tenant, credential, mode, key = sys.argv[1:7]
    if mode not in ("refused", "retrying"):
        raise SystemExit(f"unknown mode {mode!r}")
    with Client.connect(host, int(port), int(tenant), credential) as client:
        if mode == "refused":
            a = client.submit(**task(key))
        else:
            a = client.submit_retrying(tries=100, **task(key))
    check(mode, a, "blocking")
    a = asyncio.run(with_asyncio(host, int(port), int(tenant), credential, mode, key + "-aio"))
    check(mode, a, "asyncio")


if __name__ == "__main__":
    main()
