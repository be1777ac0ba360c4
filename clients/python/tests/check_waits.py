"""Reads the wait a node tells through the Python client, and checks it against the queue:
in a steady lane (a standing queue, every provider slot busy), a batch's tasks are told when
each will start — on the admission, and again on a read while they wait — and the deepest one
starts within a quarter of both (what a loaded machine keeps with jobs of a second; see
provider::the_expected_start_on_the_wire_is_within_a_quarter_of_the_actual_start). Prints one
line per check; exits non-zero on any surprise.

    python3 clients/python/tests/check_waits.py HOST PORT TENANT CREDENTIAL
"""

import sys
import time

from spindle_client import Client

SPEC = dict(user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)


def wait_until(read, done, budget_s=60.0):
    deadline = time.monotonic() + budget_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.01)
        value = read()
    return value


def main():
    host, port, tenant, credential = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    client = Client.connect(host, port, tenant, credential)
    warm = client.submit_batch([dict(key=f"py-warm{i}", **SPEC) for i in range(72)])
    assert all(a["decision"] == 0 for a in warm), warm
    # The rate is measured once 40 have finished (the rest keep the lane's slots busy).
    state = wait_until(lambda: client.get(warm[39]["task_id"])["state"],
                       lambda s: s == "Succeeded")
    assert state == "Succeeded", state
    print("steady")

    batch = client.submit_batch([dict(key=f"py-timed{i}", **SPEC) for i in range(40)])
    answered = time.monotonic()
    assert all(a["decision"] == 0 for a in batch), batch
    told = [a["expected_start_ms"] for a in batch]
    assert told == sorted(told), f"later tasks of the batch wait longer: {told}"
    last = batch[-1]["task_id"]
    time.sleep(1.0)
    status = client.get(last)
    asked = time.monotonic()
    assert status["state"] == "Queued", status
    told_when_asked = status["expected_start_ms"]
    assert 0 < told_when_asked < told[-1], (told_when_asked, told[-1])
    print("told on the wire")

    state = wait_until(lambda: client.get(last)["state"], lambda s: s != "Queued")
    assert state != "Queued", state
    now = time.monotonic()
    for (said, since) in ((told[-1], answered), (told_when_asked, asked)):
        actual_ms = (now - since) * 1000.0
        assert abs(said - actual_ms) <= actual_ms / 4, f"told {said} ms, started after {actual_ms:.0f} ms"
    print("started as told")


if __name__ == "__main__":
    main()
