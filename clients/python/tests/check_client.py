"""Drives a running spindled through the Python client: submit, read status until the task
has run, and receive an error. Prints one line per step; exits non-zero on any surprise.

    python3 clients/python/tests/check_client.py HOST PORT TENANT CREDENTIAL [--cluster] [--tls-ca FILE
        [--tls-cert FILE --tls-key FILE]]

With --cluster, HOST:PORT may be any node of a cluster: the client connects through it
(Client.connect_cluster) and first prints the node that serves the tenant. With --tls-ca, the
node's port speaks TLS and its certificate chains to the CA certificates in FILE; with
--tls-cert and --tls-key the client presents that certificate (a node with `client_ca_file`).
"""

import ssl
import sys
import time

from spindle_client import BATCH_MAX, Client, SpindleError


def main():
    host, port, tenant, credential = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    flags = sys.argv[5:]
    cluster = "--cluster" in flags
    tls = None
    if "--tls-ca" in flags:
        tls = ssl.create_default_context(cafile=flags[flags.index("--tls-ca") + 1])
        if "--tls-cert" in flags:
            tls.load_cert_chain(flags[flags.index("--tls-cert") + 1],
                                flags[flags.index("--tls-key") + 1])
    connect = Client.connect_cluster if cluster else Client.connect
    client = connect(host, port, tenant, credential, tls=tls)
    if cluster:
        print(f"served by {client.node_id}")
    admission = client.submit("python-1", user=1, model=0, width=1280, height=720,
                              duration_ms=5000, fps=24,
                              input={"prompt": "a paper boat on a canal", "seed": 7})
    assert admission["decision"] == 0, admission  # ACCEPTED
    print(f"submitted task {admission['task_id']}")
    spec = dict(user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)
    batch = client.submit_batch([dict(key="python-b1", **spec), dict(key="python-b2", **spec),
                                 dict(key="python-1", input={"prompt": "a paper boat on a canal",
                                                             "seed": 7}, **spec)])
    assert [a["decision"] for a in batch] == [0, 0, 0], batch
    # The third repeats the first submit's key and request: a replay of the same task.
    assert batch[2]["task_id"] == admission["task_id"], (batch, admission)
    print(f"batch of {len(batch)}, replays {sum(a['replay'] for a in batch)}")
    for size in (0, BATCH_MAX + 1):
        try:
            client.submit_batch([dict(key=f"python-x{i}", **spec) for i in range(size)])
        except SpindleError as e:
            assert e.code == "BatchTooLarge", e
        else:
            raise AssertionError(f"a batch of {size} must be refused")
    state = None
    for _ in range(2000):
        state = client.get(admission["task_id"])["state"]
        if state == "Succeeded":
            break
        time.sleep(0.005)
    assert state == "Succeeded", state
    print(f"status {state}")
    try:
        client.cancel(admission["task_id"])
    except SpindleError as e:
        assert e.code == "NotFound", e
        print(f"error {e.code}: {e.message}")
    else:
        raise AssertionError("a task that has ended cannot be canceled")
    try:
        client.get(999_999_999)
    except SpindleError as e:
        assert e.code == "NotFound", e
        print(f"error {e.code}: {e.message}")
    else:
        raise AssertionError("a missing task must be an error")
    try:
        client.submit("python-2", user=1, model=0, width=1280, height=720, duration_ms=5000,
                      fps=24, input='{"prompt": "unclosed')
    except SpindleError as e:
        assert e.code == "InvalidInput", e
        print(f"error {e.code}: {e.message}")
    else:
        raise AssertionError("an input that is not JSON must be refused")
    try:
        connect(host, port, tenant, credential + "-wrong", tls=tls)
    except SpindleError as e:
        assert e.code == "AuthFailed", e
        print(f"error {e.code}")
    else:
        raise AssertionError("a wrong credential must be refused")
    client.close()


if __name__ == "__main__":
    main()
