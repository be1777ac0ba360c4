"""Drives a running spindled through the SDK's AsyncClient: twenty submits awaited at once on
one connection (pipelined, each answer matched to its call), a batch with a replay, a task
followed by its events to its end, reads and refusals. Prints one line per step; exits
non-zero on any surprise.

    python3 clients/python/tests/check_async.py HOST PORT TENANT CREDENTIAL
"""

import asyncio
import sys

from spindle_client import TERMINAL_STATES, AsyncClient, SpindleError, accepted

SPEC = dict(user=1, model=0, width=1280, height=720, duration_ms=5000, fps=24)


async def main():
    host, port, tenant, credential = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    async with await AsyncClient.connect(host, port, tenant, credential) as client:
        answers = await asyncio.gather(
            *(client.submit(f"aio-{i}", **SPEC) for i in range(20)))
        assert all(accepted(a) for a in answers), answers
        ids = {a["task_id"] for a in answers}
        assert len(ids) == 20, answers
        print(f"pipelined {len(ids)} submits")

        batch = await client.submit_batch(
            [dict(key="aio-b1", **SPEC), dict(key="aio-b2", **SPEC), dict(key="aio-0", **SPEC)])
        replays = sum(a["replay"] for a in batch)
        assert batch[2]["task_id"] == answers[0]["task_id"], (batch, answers[0])
        print(f"batch of {len(batch)}, replays {replays}")

        followed = await client.submit("aio-followed", input={"prompt": "a lighthouse"}, **SPEC)
        task = followed["task_id"]
        states = []
        end_result = None
        try:
            await client.subscribe(task)
        except SpindleError as e:
            # Ended already (a fast provider): its end is read instead.
            assert e.code == "NotFound", e
            states.append((await client.get(task))["state"])
        while not states or states[-1] not in TERMINAL_STATES:
            event = await client.next_event(timeout=60)
            assert event is not None, f"no event within 60 s after {states}"
            assert event["task_id"] == task, event
            states.append(event["state"])
            end_result = event["result"]
        assert states[-1] == "Succeeded", states
        print(f"followed to {states[-1]}")

        # Read after the end's event, the task is found ended, with the event's result (the
        # node tells an end once it is stored).
        status = await client.get(task)
        assert status["state"] == "Succeeded" and status["result"] == end_result, (status, end_result)
        print("status Succeeded as told")

        for bad in (task, 999_999_999):
            try:
                await client.cancel(bad)
            except SpindleError as e:
                print(f"error {e.code}")
            else:
                raise AssertionError(f"cancel of {bad} must be refused")

    # Events nobody reads are held only up to events_max (here none): then the connection is
    # closed with EventsNotRead, and every later call raises it.
    unread = await AsyncClient.connect(host, port, tenant, credential)
    unread.events_max = 0
    late = (await unread.submit("aio-unread", **SPEC))["task_id"]
    try:
        await unread.subscribe(late)
        for _ in range(600):
            await unread.get(late)
            await asyncio.sleep(0.05)
    except SpindleError as e:
        print(f"error {e.code}")
    else:
        raise AssertionError("an event past events_max must close the connection")
    finally:
        await unread.close()


if __name__ == "__main__":
    asyncio.run(main())
