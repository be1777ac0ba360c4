"""Submits one task to a spindle node and follows it to its result. Waits up to two minutes
for the node to start serving (it may still be building or starting its PostgreSQL).

    python quickstart.py HOST:PORT TENANT CREDENTIAL
"""

import sys
import time

from spindle_client import TERMINAL_STATES, Client, SpindleError, accepted


def main() -> None:
    address, tenant, credential = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + 120
    while True:
        try:
            client = Client.connect(host, int(port), tenant, credential)
            break
        except OSError as e:  # not listening yet
            if time.monotonic() > deadline:
                raise SystemExit(f"no node at {address} within 120 s: {e}")
            time.sleep(0.5)
    with client:
        admission = client.submit_retrying(
            key="quickstart-1", user=1, model=0, width=1280, height=720,
            duration_ms=5000, fps=24, input={"prompt": "a paper boat on a canal"})
        if not accepted(admission):
            raise SystemExit(f"refused: {admission['reason']}")
        task = admission["task_id"]
        print(f"task {task} accepted, expected to start in {admission['expected_start_ms']} ms")
        try:
            client.subscribe(task)
            state = "Queued"
        except SpindleError as e:
            if e.code != "NotFound":
                raise
            state = client.get(task)["state"]  # ended already (or sent before: a replay)
        while state not in TERMINAL_STATES:
            event = client.next_event(timeout=120)
            if event is None:
                raise SystemExit("no event within 120 s")
            state = event["state"]
            print(f"{state} {event['progress_pct']}%")
        status = client.get(task)
        # The built-in local provider makes no video: its result is None. A real provider's
        # is its output URL; the media stage's, the renditions.
        print(f"{status['state']}; result: {status['result']}")


if __name__ == "__main__":
    main()
