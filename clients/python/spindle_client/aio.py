"""The asyncio client: `AsyncClient`, one connection to one node with the same calls as
`Client`, each a coroutine. Calls are pipelined: any number of tasks may await calls on one
connection at once (up to IN_FLIGHT_MAX), each answer matched to its request by id; events of
subscribed tasks are kept for `next_event` (at most EVENTS_MAX unread).

    async with await AsyncClient.connect("127.0.0.1", 7070, tenant=1,
                                         credential="tenant-1-credential") as client:
        admission = await client.submit("order-17", user=3, model=0, width=1280,
                                        height=720, duration_ms=5000, fps=24)
        await client.subscribe(admission["task_id"])
        while (event := await client.next_event(timeout=60)) is not None:
            print(event["state"], event["progress_pct"])
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import Any, Deque, Dict, List, Optional, Tuple

from spindle_client import _protocol as p
from spindle_client._protocol import (
    EVENTS_MAX,
    REJECT_PLATFORM_OVERLOADED,
    REQUEST_TIMEOUT,
    Admission,
    JsonInput,
    SpindleError,
    TaskEvent,
    TaskStatus,
)
from spindle_client.client import address

# Calls awaiting their answers on one connection; one more waits for a place.
IN_FLIGHT_MAX = 1024


class AsyncClient:
    """One authenticated connection to one node, for asyncio."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout: float) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout = timeout
        self._next_id = 1
        self._pending: Dict[int, "asyncio.Future[Any]"] = {}
        self._places = asyncio.Semaphore(IN_FLIGHT_MAX)
        self._events: Deque[TaskEvent] = collections.deque()
        # Events that may wait unread before the connection is closed (EventsNotRead).
        self.events_max = EVENTS_MAX
        self._event_ready = asyncio.Event()
        # Why the connection ended, once it has: every later call raises it.
        self._closed: Optional[SpindleError] = None
        self._reading = asyncio.ensure_future(self._read_loop())
        # The node that serves this connection (its HelloOk).
        self.node_id = ""

    @classmethod
    async def connect(cls, host: str, port: int, tenant: int, credential: str,
                      tls: Optional[ssl.SSLContext] = None,
                      timeout: float = REQUEST_TIMEOUT) -> "AsyncClient":
        """Connects and authenticates as `tenant` (as Client.connect). Every call waits at
        most `timeout` seconds for its answer (Timeout)."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=tls,
                                    server_hostname=host if tls is not None else None),
            timeout,
        )
        client = cls(reader, writer, timeout)
        try:
            ok = await client._answer(p.HELLO, p.hello(tenant, credential))
        except BaseException:
            await client.close()
            raise
        client.node_id = p.node_id(ok)
        return client

    @classmethod
    async def connect_cluster(cls, host: str, port: int, tenant: int, credential: str,
                              redirects_max: int = 4, tls: Optional[ssl.SSLContext] = None,
                              timeout: float = REQUEST_TIMEOUT) -> "AsyncClient":
        """connect() through any node of a cluster, following WrongNode's redirect (as
        Client.connect_cluster)."""
        visited: List[str] = []
        while True:
            try:
                return await cls.connect(host, port, tenant, credential, tls=tls,
                                         timeout=timeout)
            except SpindleError as e:
                if e.code != "WrongNode" or e.redirect is None:
                    raise
                visited.append(f"{host}:{port}")
                if len(visited) > redirects_max or e.redirect in visited:
                    raise SpindleError(
                        "WrongNode",
                        f"{e.message} (sent on from {' to '.join(visited)} without reaching "
                        f"the node that serves tenant {tenant})",
                    ) from e
                host, port = address(e.redirect)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.close()

    async def _answer(self, call: Tuple[int, int, Any], body: p.Body, size: int = 256) -> Any:
        request_type, answer_type, table = call
        async with self._places:
            if self._closed is not None:
                raise self._closed
            request_id = self._next_id
            self._next_id += 1
            answer: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()
            self._pending[request_id] = answer
            try:
                self._writer.write(p.frame(request_id, request_type, body, size))
                await self._writer.drain()
                frame = await asyncio.wait_for(answer, self._timeout)
            except asyncio.TimeoutError as e:
                raise SpindleError("Timeout", f"no answer within {self._timeout} s") from e
            finally:
                self._pending.pop(request_id, None)
        if table is None:
            p.raise_error(frame)
            return None
        return p.body_as(frame, request_type, answer_type, table)

    async def _read_loop(self) -> None:
        """Reads every frame of the connection: answers to their callers, events to the
        queue; the connection's end (or the node's last word) to every caller waiting."""
        why = SpindleError("Closed", "the node closed the connection")
        try:
            while True:
                length = p.frame_length(await self._reader.readexactly(4))
                frame = p.response(await self._reader.readexactly(length))
                if p.is_event(frame):
                    if len(self._events) >= self.events_max:
                        why = SpindleError(
                            "EventsNotRead",
                            f"more than {self.events_max} events held unread (read them with "
                            "next_event); the connection is closed",
                        )
                        return
                    self._events.append(p.event(frame))
                    self._event_ready.set()
                    continue
                waiting = self._pending.get(frame.RequestId())
                if waiting is not None and not waiting.done():
                    waiting.set_result(frame)
                elif frame.RequestId() == 0:
                    # The node's last word before it closes the connection.
                    try:
                        p.raise_error(frame)
                    except SpindleError as e:
                        why = e
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except SpindleError as e:
            why = e
        finally:
            self._end(why)

    def _end(self, why: SpindleError) -> None:
        if self._closed is None:
            self._closed = why
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(self._closed)
        self._event_ready.set()
        self._writer.close()

    async def submit(self, key: str, user: int, model: int, width: int, height: int,
                     duration_ms: int, fps: int, audio: bool = False, references: int = 0,
                     band_hint: int = 0, input: JsonInput = None) -> Admission:
        """Submits one task; its admission (as Client.submit)."""
        task = dict(key=key, user=user, model=model, width=width, height=height,
                    duration_ms=duration_ms, fps=fps, audio=audio, references=references,
                    band_hint=band_hint, input=input)
        return p.admission(await self._answer(p.SUBMIT, p.one_task(task)))

    async def submit_retrying(self, tries: int = 5, **task: Any) -> Admission:
        """submit, sent again while the node refuses it for its load, after each admission's
        retry_after_ms (at least 1 ms), at most `tries` times; the last admission."""
        for _ in range(max(1, tries) - 1):
            a = await self.submit(**task)
            if a["decision"] != REJECT_PLATFORM_OVERLOADED:
                return a
            await asyncio.sleep(max(a["retry_after_ms"], 1) / 1000)
        return await self.submit(**task)

    async def submit_batch(self, tasks: List[dict]) -> List[Admission]:
        """Submits 1..=BATCH_MAX tasks in one frame; their admissions in order."""
        r = await self._answer(p.BATCH, p.batch(tasks), 256 * max(1, len(tasks)))
        return p.admissions(r)

    async def get(self, task_id: int) -> TaskStatus:
        """A task's state, progress and (once Succeeded) result."""
        return p.status(await self._answer(p.GET, p.by_task(p.TABLES["get"], task_id)))

    async def cancel(self, task_id: int) -> str:
        """Cancels a queued or running task (as Client.cancel)."""
        c = await self._answer(p.CANCEL, p.by_task(p.TABLES["cancel"], task_id))
        return p.canceled_state(c)

    async def subscribe(self, task_id: int) -> None:
        """Asks for a live task's events, read with next_event (as Client.subscribe)."""
        await self._answer(p.SUBSCRIBE, p.by_task(p.TABLES["subscribe"], task_id))

    async def next_event(self, timeout: Optional[float] = None) -> Optional[TaskEvent]:
        """The next event of any subscription; None when none came within `timeout` seconds
        (None: wait). Once the connection has ended and its events are read, raises why."""
        while not self._events:
            if self._closed is not None:
                raise self._closed
            self._event_ready.clear()
            try:
                await asyncio.wait_for(self._event_ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self._events.popleft()

    async def close(self) -> None:
        """Closes the connection; calls still waiting raise Closed."""
        self._end(SpindleError("Closed", "the client closed the connection"))
        self._reading.cancel()
        try:
            await self._reading
        except (asyncio.CancelledError, Exception):
            pass
