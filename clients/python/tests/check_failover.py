"""Drives a cluster through the Python ClusterClient across the death of its node: submits,
subscribes to another, waits for a line on stdin (the caller kills the serving node
meanwhile), submits again — the client fails over to a node that serves the tenant once it
does — sends the first submit again (a replay of the same task), reads the second task until it
has run, and receives the watched task's end across the failover. Prints one line per
step; exits non-zero on any surprise.

    python3 clients/python/tests/check_failover.py TENANT CREDENTIAL SEED [SEED...]
"""

import sys
import time

from spindle_client import CLUSTER_SUBSCRIPTIONS_MAX, TERMINAL_STATES, ClusterClient, SpindleError

SPEC = dict(user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)


def main():
    tenant, credential, seeds = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    cluster = ClusterClient(seeds, tenant, credential)
    print(f"served by {cluster.node_id}")
    before = cluster.submit("python-before", **SPEC)
    assert before["decision"] == 0 and not before["replay"], before  # ACCEPTED
    # A task watched across the failover: its end comes from whichever node has it then.
    watched = cluster.submit("python-watched", **SPEC)["task_id"]
    cluster.subscribe(watched)
    # Its bound: past it, another task is refused (and nothing of it kept); the held one is
    # asked for again, not counted twice.
    cluster.subscriptions_max = 1
    cluster.subscribe(watched)
    try:
        cluster.subscribe(before["task_id"])
    except SpindleError as e:
        assert e.code == "TooManySubscriptions", e
    else:
        raise AssertionError("a subscription past the bound must be refused")
    assert cluster.subscribed == {watched}, cluster.subscribed
    cluster.subscriptions_max = CLUSTER_SUBSCRIPTIONS_MAX
    print("ready", flush=True)
    sys.stdin.readline()
    after = cluster.submit("python-after", **SPEC)
    assert after["decision"] == 0, after
    print(f"served by {cluster.node_id}")
    print(f"failovers {cluster.failovers}")
    again = cluster.submit("python-before", **SPEC)
    assert (again["task_id"], again["replay"]) == (before["task_id"], True), (again, before)
    print("replayed")
    state = None
    for _ in range(4000):
        state = cluster.get(after["task_id"])["state"]
        if state == "Succeeded":
            break
        time.sleep(0.005)
    assert state == "Succeeded", state
    print(f"status {state}")
    end = None
    while end is None:
        event = cluster.next_event(timeout=60)
        assert event is not None, "no event of the watched task within 60 s"
        if event["task_id"] == watched and event["state"] in TERMINAL_STATES:
            end = event
    print(f"watched {end['state']}")
    print(f"tasks {before['task_id']} {after['task_id']}", flush=True)
    cluster.close()


if __name__ == "__main__":
    main()
