"""Follows a task's events through the Python client: submits, subscribes, reads events until
the task ends, and is refused a subscription to a task that is not live. Prints one line per
step; exits non-zero on any surprise.

    python3 clients/python/tests/check_events.py HOST PORT TENANT CREDENTIAL
"""

import sys

from spindle_client import TERMINAL_STATES, Client, SpindleError


def main():
    host, port, tenant, credential = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    client = Client.connect(host, port, tenant, credential)
    admission = client.submit("python-events", user=1, model=0, width=1280, height=720,
                              duration_ms=5000, fps=24)
    task = admission["task_id"]
    client.subscribe(task)
    states = []
    end = None
    for _ in range(100):
        event = client.next_event(timeout=30)
        assert event is not None, f"no event within 30 s after {states}"
        assert event["task_id"] == task, event
        if not states or states[-1] != event["state"]:
            states.append(event["state"])
        if event["state"] in TERMINAL_STATES:
            end = event
            break
    assert end is not None, states
    print("events " + " ".join(states))
    print(f"result {'yes' if end['result'] is not None else 'no'} at 100 {end['progress_pct'] == 100}")
    try:
        client.subscribe(task)
    except SpindleError as e:
        print(f"error {e.code}")
    else:
        raise AssertionError("an ended task cannot be subscribed to")
    client.close()
    # Events nobody reads are held only up to EVENTS_MAX (here none): then the connection is
    # closed with EventsNotRead rather than growing without bound.
    unread = Client.connect(host, port, tenant, credential)
    unread.events_max = 0
    late = unread.submit("python-unread", user=1, model=0, width=1280, height=720,
                         duration_ms=5000, fps=24)["task_id"]
    try:
        unread.subscribe(late)
        unread.get(late)
    except SpindleError as e:
        print(f"error {e.code}")
    else:
        raise AssertionError("an event past EVENTS_MAX must close the connection")


if __name__ == "__main__":
    main()
