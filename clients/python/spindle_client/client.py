"""The synchronous client: `Client`, one connection to one node, and `ClusterClient`, which
fails over between the nodes of a cluster. Calls block until their answer; events of
subscribed tasks that arrive meanwhile are kept for `next_event`."""

from __future__ import annotations

import collections
import select
import socket
import ssl
import time
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple, TypeVar

from spindle_client import _protocol as p
from spindle_client._protocol import (
    EVENTS_MAX,
    REJECT_PLATFORM_OVERLOADED,
    REQUEST_TIMEOUT,
    TERMINAL_STATES,
    Admission,
    JsonInput,
    SpindleError,
    TaskEvent,
    TaskStatus,
)

T = TypeVar("T")


class Client:
    """One authenticated connection to one node.

        client = Client.connect("127.0.0.1", 7070, tenant=1, credential="tenant-1-credential")
        admission = client.submit("order-17", user=3, model=0, width=1280, height=720,
                                  duration_ms=5000, fps=24)
        status = client.get(admission["task_id"])
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.next_id = 1
        # The node that serves this connection (its HelloOk).
        self.node_id = ""
        # Events of subscribed tasks read while waiting for an answer, oldest first, and how
        # many may wait unread before the connection is closed (EventsNotRead).
        self.events: Deque[TaskEvent] = collections.deque()
        self.events_max = EVENTS_MAX

    @classmethod
    def connect(cls, host: str, port: int, tenant: int, credential: str,
                tls: Optional[ssl.SSLContext] = None,
                timeout: float = REQUEST_TIMEOUT) -> "Client":
        """Connects and authenticates as `tenant`. `host` is a name or an address. Where the
        node's port speaks TLS, `tls` is an ssl.SSLContext that trusts its certificate
        (ssl.create_default_context(cafile=...)): the certificate must name `host`. Every
        call waits at most `timeout` seconds for its answer (Timeout)."""
        sock = socket.create_connection((host, port), timeout=timeout)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        client = cls(sock)
        try:
            ok = client._answer(p.HELLO, p.hello(tenant, credential))
        except BaseException:
            client.close()
            raise
        client.node_id = p.node_id(ok)
        return client

    @classmethod
    def connect_cluster(cls, host: str, port: int, tenant: int, credential: str,
                        redirects_max: int = 4, tls: Optional[ssl.SSLContext] = None,
                        timeout: float = REQUEST_TIMEOUT) -> "Client":
        """connect() through any node of a cluster: a node that does not serve the tenant
        answers WrongNode with the address of the one that does, and this follows it — at
        most redirects_max times, never twice to one address."""
        visited: List[str] = []
        while True:
            try:
                return cls.connect(host, port, tenant, credential, tls=tls, timeout=timeout)
            except SpindleError as e:
                if e.code != "WrongNode" or e.redirect is None:
                    raise
                visited.append(f"{host}:{port}")
                if len(visited) > redirects_max or e.redirect in visited:
                    path = " to ".join(visited)
                    raise SpindleError(
                        "WrongNode",
                        f"{e.message} (sent on from {path} without reaching the node that "
                        f"serves tenant {tenant})",
                    ) from e
                host, port = address(e.redirect)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _answer(self, call: Tuple[int, int, Any], body: p.Body, size: int = 256) -> Any:
        """Sends a request and reads its answer's body (`call`: request type, answer type,
        generated table; None for a table: no body wanted)."""
        request_type, answer_type, table = call
        frame = self._call(request_type, body, size)
        if table is None:
            p.raise_error(frame)
            return None
        return p.body_as(frame, request_type, answer_type, table)

    def _call(self, body_type: int, body: p.Body, size: int) -> Any:
        request_id = self.next_id
        self.next_id += 1
        try:
            self.sock.sendall(p.frame(request_id, body_type, body, size))
            frame = self._read_frame()
            # A subscription's events come on its Subscribe's request id, in between answers
            # (even before the Subscribe's own): kept for next_event.
            while p.is_event(frame):
                self._keep(frame)
                frame = self._read_frame()
        except socket.timeout as e:
            self.close()
            raise SpindleError("Timeout", "no answer within the client's timeout; the "
                               "connection is closed") from e
        # Request id 0 is the connection's: the node's last word before it closes it (a
        # framing error, or the tenant suspended by the breaker), raised as it is.
        if frame.RequestId() not in (request_id, 0):
            raise SpindleError("Unexpected", f"answer to {frame.RequestId()}, not {request_id}")
        p.raise_error(frame)
        return frame

    def _read_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise SpindleError("Closed", "the node closed the connection")
            data += chunk
        return data

    def _read_frame(self) -> Any:
        length = p.frame_length(self._read_exact(4))
        return p.response(self._read_exact(length))

    def submit(self, key: str, user: int, model: int, width: int, height: int,
               duration_ms: int, fps: int, audio: bool = False, references: int = 0,
               band_hint: int = 0, input: JsonInput = None) -> Admission:
        """Submits one task; its admission (task_id, decision — 0 is accepted —, replay,
        reason, expected_start_ms, retry_after_ms). `input`: what to generate, for the
        provider — a dict/list (sent as JSON) or a JSON text, at most 16 KiB."""
        task = dict(key=key, user=user, model=model, width=width, height=height,
                    duration_ms=duration_ms, fps=fps, audio=audio, references=references,
                    band_hint=band_hint, input=input)
        return p.admission(self._answer(p.SUBMIT, p.one_task(task)))

    def submit_retrying(self, tries: int = 5, **task: Any) -> Admission:
        """Submits one task (submit's arguments by name), sending it again while the node
        refuses it for its load (REJECT_PLATFORM_OVERLOADED), each time after the admission's
        retry_after_ms (at least 1 ms), at most `tries` times; the last admission."""
        for _ in range(max(1, tries) - 1):
            a = self.submit(**task)
            if a["decision"] != REJECT_PLATFORM_OVERLOADED:
                return a
            time.sleep(max(a["retry_after_ms"], 1) / 1000)
        return self.submit(**task)

    def submit_batch(self, tasks: List[dict]) -> List[Admission]:
        """Submits 1..=BATCH_MAX tasks in one frame, each a dict of submit's arguments; their
        admissions in order (one group commit for all that are accepted)."""
        r = self._answer(p.BATCH, p.batch(tasks), 256 * max(1, len(tasks)))
        return p.admissions(r)

    def get(self, task_id: int) -> TaskStatus:
        """A task's state, progress and (once Succeeded) result."""
        return p.status(self._answer(p.GET, p.by_task(p.TABLES["get"], task_id)))

    def cancel(self, task_id: int) -> str:
        """Cancels a queued or running task of this tenant; answers its state, Canceled, once
        the cancel is stored (a task at the provider is asked to stop). A task that has ended,
        or no task of this tenant, raises NotFound."""
        return p.canceled_state(self._answer(p.CANCEL, p.by_task(p.TABLES["cancel"], task_id)))

    def subscribe(self, task_id: int) -> None:
        """Asks for a live task's events (state, progress milestone, and with Succeeded its
        result); they come through next_event until the task ends. A task this node does not
        hold live (ended, or unknown) raises NotFound: read it with get."""
        self._answer(p.SUBSCRIBE, p.by_task(p.TABLES["subscribe"], task_id))

    def next_event(self, timeout: Optional[float] = None) -> Optional[TaskEvent]:
        """The next event of any subscription (task_id, state, progress_pct, at_ms, result);
        None when none came within `timeout` seconds (None: wait)."""
        if self.events:
            return self.events.popleft()
        # Over TLS, bytes already decrypted wait in the socket's buffer where select cannot
        # see them.
        buffered = getattr(self.sock, "pending", lambda: 0)()
        if not buffered and not select.select([self.sock], [], [], timeout)[0]:
            return None
        frame = self._read_frame()
        if not p.is_event(frame):
            # The node's last word on the connection (request id 0), raised as it is.
            p.raise_error(frame)
            raise SpindleError("Unexpected", f"answer type {frame.BodyType()} with no request")
        self._keep(frame)
        return self.events.popleft()

    def _keep(self, frame: Any) -> None:
        if len(self.events) >= self.events_max:
            self.close()
            raise SpindleError(
                "EventsNotRead",
                f"more than {self.events_max} events held unread (read them with next_event); "
                "the connection is closed",
            )
        self.events.append(p.event(frame))

    def close(self) -> None:
        self.sock.close()


def address(seed: str) -> Tuple[str, int]:
    """("host", port) of "host:port" (a name, an IPv4 address, or a bracketed IPv6 one)."""
    host, sep, port = seed.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{seed!r} is not host:port")
    return host, int(port)


# How long a ClusterClient request keeps failing over by default, in seconds: past the default
# partition lease (30 s) with room for the takeover (as the Rust client's FAILOVER_WITHIN).
FAILOVER_WITHIN = 60.0
FAILOVER_PAUSE = 0.05
FAILOVER_PAUSE_MAX = 2.0
SEEDS_MAX = 64
# Tasks a ClusterClient keeps subscribed across failovers (a node holds at most 100,000
# subscriptions per shard).
CLUSTER_SUBSCRIPTIONS_MAX = 100_000
# Rounds of subscribing again to a task stored as not ended but not live on the new node yet.
RESUBSCRIBE_TRIES = 10
RESUBSCRIBE_PAUSE = 0.1

# Refusals another node (or the same one a moment later) answers otherwise.
# Overloaded: the node holds its most connections (connections_max); one may free meanwhile.
_FAILOVER_CODES = {"Closed", "WrongNode", "Draining", "Unavailable", "Overloaded"}


def _fails_over(error: BaseException) -> bool:
    """Whether a request that failed with `error` is sent again on a fresh connection: the
    connection's end or a socket error (a timeout among them), or a node that cannot serve
    the tenant now. A wrong credential, a suspended tenant or a refused request is not."""
    if isinstance(error, SpindleError):
        return error.code in _FAILOVER_CODES
    return isinstance(error, OSError)


class ClusterClient:
    """A client of a cluster of nodes: one connection at a time, to the node that serves the
    tenant (found through the seeds, any nodes' client addresses, following redirects),
    replaced when a request meets its end, a node that no longer serves the tenant, a
    draining node or a PostgreSQL the node cannot reach. The request is then sent again on a
    fresh connection, pausing 50 ms doubling to 2 s; no try starts past `failover_within`
    seconds. Sending again is safe: a submit carries its idempotency key (a replay is
    answered with the first admission), a cancel is stored once, a read changes nothing.

    Subscriptions move with the connection (as the Rust ClusterClient's): a fresh one
    subscribes again to every task still subscribed, and the node's first event for each is
    its state then; a task that ended while no connection was up is read and given as its end
    (stamped with this machine's clock); one stored as not ended that the new node does not
    hold live within about a second is given as its state then and no longer followed. The
    milestones passed during the gap are not replayed.

        cluster = ClusterClient(["10.0.0.5:7070", "10.0.0.6:7070"], tenant=1,
                                credential="secret")
        admission = cluster.submit("order-17", user=3, model=0, width=1280, height=720,
                                   duration_ms=5000, fps=24)
    """

    def __init__(self, seeds: Sequence[str], tenant: int, credential: str,
                 failover_within: float = FAILOVER_WITHIN,
                 tls: Optional[ssl.SSLContext] = None) -> None:
        if not 1 <= len(seeds) <= SEEDS_MAX:
            raise ValueError(f"a cluster client takes 1..={SEEDS_MAX} seeds, not {len(seeds)}")
        self.seeds = [address(seed) for seed in seeds]
        self.tenant = tenant
        self.credential = credential
        # Where the nodes' ports speak TLS: the ssl.SSLContext every connection uses.
        self.tls = tls
        self.failover_within = failover_within
        self.client: Optional[Client] = None
        # Connections replaced after a failure.
        self.failovers = 0
        # Tasks subscribed to and not yet ended, and ends read after a failover, given first.
        self.subscribed: set = set()
        self.caught_up: Deque[TaskEvent] = collections.deque()
        self.subscriptions_max = CLUSTER_SUBSCRIPTIONS_MAX
        self._call(lambda client: None)

    @property
    def node_id(self) -> str:
        """The node that serves the connection in use (connecting if none is)."""
        return self._call(lambda client: client.node_id)

    def submit(self, *args: Any, **kwargs: Any) -> Admission:
        """Client.submit, failing over (sent again with its idempotency key)."""
        return self._call(lambda client: client.submit(*args, **kwargs))

    def submit_batch(self, tasks: List[dict]) -> List[Admission]:
        """Client.submit_batch, failing over (sent again whole, every key with it)."""
        return self._call(lambda client: client.submit_batch(tasks))

    def get(self, task_id: int) -> TaskStatus:
        """Client.get, failing over."""
        return self._call(lambda client: client.get(task_id))

    def cancel(self, task_id: int) -> str:
        """Client.cancel, failing over (a cancel is stored once)."""
        return self._call(lambda client: client.cancel(task_id))

    def subscribe(self, task_id: int) -> None:
        """Client.subscribe, on this connection and every later one, until the task ends. A
        task subscribed already is asked for again, not counted twice."""
        fresh = task_id not in self.subscribed
        if fresh and len(self.subscribed) >= self.subscriptions_max:
            raise SpindleError(
                "TooManySubscriptions",
                f"a cluster client keeps at most {self.subscriptions_max} subscriptions "
                f"(task {task_id} refused until one of them ends)",
            )
        # Kept before it is asked for, so that a failover in between subscribes the new
        # connection too (at worst twice: the same events twice, never none).
        self.subscribed.add(task_id)
        try:
            self._call(lambda client: client.subscribe(task_id))
        except Exception:
            if fresh:
                self.subscribed.discard(task_id)
            raise

    def next_event(self, timeout: Optional[float] = None) -> Optional[TaskEvent]:
        """The next event of any subscription, across failovers; None when none came within
        `timeout` seconds (None: wait)."""
        event = self._call(
            lambda client: self.caught_up.popleft() if self.caught_up
            else client.next_event(timeout)
        )
        if event is not None and event["state"] in TERMINAL_STATES:
            self.subscribed.discard(event["task_id"])
        return event

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def _resubscribe(self, client: Client) -> None:
        """Subscribes `client`, a fresh connection, to every task still subscribed. A task not
        live on it is read: an ended one's end is queued as an event; one stored as not ended
        is asked for again a few times, and past them its state is queued and it is let go."""
        tasks = list(self.subscribed)
        for round_no in range(1, RESUBSCRIBE_TRIES + 1):
            not_yet = []
            for task in tasks:
                try:
                    client.subscribe(task)
                    continue
                except SpindleError as e:
                    if e.code != "NotFound":
                        raise
                try:
                    status = client.get(task)
                except SpindleError as e:
                    if e.code != "NotFound":
                        raise
                    # Gone for this tenant (pruned): nothing more will come of it.
                    self.subscribed.discard(task)
                    continue
                if status["state"] in TERMINAL_STATES or round_no == RESUBSCRIBE_TRIES:
                    self.subscribed.discard(task)
                    self.caught_up.append({
                        "task_id": task,
                        "state": status["state"],
                        "progress_pct": status["progress_pct"],
                        "at_ms": int(time.time() * 1000),
                        "result": status["result"],
                    })
                else:
                    not_yet.append(task)
            if not not_yet:
                return
            tasks = not_yet
            time.sleep(RESUBSCRIBE_PAUSE)

    def _call(self, request: Callable[[Client], T]) -> T:
        deadline = time.monotonic() + self.failover_within
        pause = FAILOVER_PAUSE
        while True:
            try:
                return request(self._connection())
            except (OSError, SpindleError) as e:
                if not _fails_over(e):
                    raise
                failed: BaseException = e
            # The connection may be mid-frame or dead: never used again. Events it read and
            # nobody took yet are given before the next connection's.
            if self.client is not None:
                self.caught_up.extend(self.client.events)
                self.client.close()
                self.client = None
                self.failovers += 1
            if time.monotonic() + pause > deadline:
                raise failed
            time.sleep(pause)
            pause = min(pause * 2, FAILOVER_PAUSE_MAX)

    def _connection(self) -> Client:
        """The connection in use, or a new one: each seed in turn, following redirects; the
        last seed's failure if none serves."""
        if self.client is not None:
            return self.client
        failed: Optional[BaseException] = None
        for host, port in self.seeds:
            client = None
            try:
                client = Client.connect_cluster(host, port, self.tenant, self.credential,
                                                tls=self.tls)
                self._resubscribe(client)
                self.client = client
                return client
            except (OSError, SpindleError) as e:
                if client is not None:
                    client.close()
                if not _fails_over(e):
                    raise
                failed = e
        assert failed is not None  # there is at least one seed
        raise failed
