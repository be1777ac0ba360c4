"""A small synchronous Python client for spindle's protocol, built on the code flatc generates
from the same schema (schemas/fbs/spindle.fbs) and the flatbuffers runtime from PyPI.

    client = Client.connect("127.0.0.1", 7070, tenant=1, credential="tenant-1-credential")
    admission = client.submit("order-17", user=3, model=0, width=1280, height=720,
                              duration_ms=5000, fps=24)
    status = client.get(admission["task_id"])

Errors from the node raise SpindleError(code_name, message). ClusterClient does the same
through any nodes of a cluster, sending a request again on another node when its node dies,
drains or no longer serves the tenant.
"""

import collections
import json
import os
import select
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "generated"))

import flatbuffers  # noqa: E402
from spindle.wire import (  # noqa: E402
    Admission,
    Canceled,
    CancelTask,
    Error,
    ErrorCode,
    Event,
    GetTask,
    Hello,
    HelloOk,
    Request,
    RequestFrame,
    Response,
    ResponseFrame,
    SubmitBatch,
    SubmitBatchResult,
    SubmitTask,
    Subscribe,
    TaskSpec,
    TaskState,
    TaskStatus,
)

PROTOCOL_VERSION = 1
IDENTIFIER = b"SPDL"
FRAME_BYTES_MAX = 1 << 20
# Tasks in one SubmitBatch (spindle_wire::BATCH_MAX).
BATCH_MAX = 1024


def _names(enum_class):
    return {v: k for k, v in vars(enum_class).items() if not k.startswith("_")}


ERROR_NAMES = _names(ErrorCode.ErrorCode)
STATE_NAMES = _names(TaskState.TaskState)
REQUEST_NAMES = _names(Request.Request)
TERMINAL_STATES = {"Succeeded", "Failed", "Canceled", "Expired"}
# Events a connection holds before they are read (as the Rust client's EVENTS_BUFFER).
EVENTS_MAX = 4096


class SpindleError(Exception):
    def __init__(self, code, message, redirect=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        # With WrongNode: "host:port" of the node that serves the tenant, when one is known.
        self.redirect = redirect


def _submit_task(b, key, user, model, width, height, duration_ms, fps, audio=False,
                 references=0, band_hint=0, input=None):
    """A SubmitTask table in `b`; its offset."""
    k = b.CreateString(key)
    if input is not None and not isinstance(input, str):
        input = json.dumps(input, separators=(",", ":"))
    i = b.CreateString(input) if input is not None else None
    TaskSpec.Start(b)
    TaskSpec.AddModel(b, model)
    TaskSpec.AddWidth(b, width)
    TaskSpec.AddHeight(b, height)
    TaskSpec.AddDurationMs(b, duration_ms)
    TaskSpec.AddFps(b, fps)
    TaskSpec.AddAudio(b, audio)
    TaskSpec.AddReferences(b, references)
    spec = TaskSpec.End(b)
    SubmitTask.Start(b)
    SubmitTask.AddIdempotencyKey(b, k)
    SubmitTask.AddUserId(b, user)
    SubmitTask.AddSpec(b, spec)
    SubmitTask.AddBandHint(b, band_hint)
    if i is not None:
        SubmitTask.AddInput(b, i)
    return SubmitTask.End(b)


def _raise_error(frame):
    """Raises the Error `frame` carries, if it carries one."""
    if frame.BodyType() != Response.Response.Error:
        return
    err = Error.Error()
    err.Init(frame.Body().Bytes, frame.Body().Pos)
    redirect = err.Redirect()
    raise SpindleError(
        ERROR_NAMES.get(err.Code(), str(err.Code())),
        err.Message().decode(),
        redirect.decode() if redirect is not None else None,
    )


def _admission(a):
    return {
        "task_id": a.TaskId(),
        "decision": a.Decision(),
        "replay": a.Replay(),
        "reason": a.Reason().decode() if a.Reason() else None,
        "queue_level": a.QueueLevel(),
        "expected_start_ms": a.ExpectedStartMs(),
        # For a refusal about the node's load (REJECT_PLATFORM_OVERLOADED): send the task again
        # no sooner than this many ms from now (see submit_retrying). 0: no hint.
        "retry_after_ms": a.RetryAfterMs(),
    }


# Decision.RejectPlatformOverloaded: refused for the node's load, with a retry hint.
REJECT_PLATFORM_OVERLOADED = 7


class Client:
    def __init__(self, sock):
        self.sock = sock
        self.next_id = 1
        # The node that serves this connection (its HelloOk).
        self.node_id = ""
        # Events of subscribed tasks read while waiting for an answer, oldest first.
        self.events = collections.deque()

    @classmethod
    def connect(cls, host, port, tenant, credential, tls=None):
        """Connects and authenticates as `tenant`. Where the node's port speaks TLS, `tls` is
        an ssl.SSLContext that trusts its certificate (ssl.create_default_context(cafile=...)):
        the certificate must name `host`."""
        sock = socket.create_connection((host, port), timeout=10)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        client = cls(sock)
        b = flatbuffers.Builder(256)
        cred = b.CreateString(credential)
        name = b.CreateString("spindle-python")
        Hello.Start(b)
        Hello.AddProtocolVersion(b, PROTOCOL_VERSION)
        Hello.AddTenantId(b, tenant)
        Hello.AddCredential(b, cred)
        Hello.AddClientName(b, name)
        body = Hello.End(b)
        ok = client._answer(b, Request.Request.Hello, body, Response.Response.HelloOk,
                            HelloOk.HelloOk)
        client.node_id = ok.NodeId().decode() if ok.NodeId() is not None else ""
        return client

    @classmethod
    def connect_cluster(cls, host, port, tenant, credential, redirects_max=4, tls=None):
        """connect() through any node of a cluster: a node that does not serve the tenant
        answers WrongNode with the address of the one that does, and this follows it — at
        most redirects_max times, never twice to one address."""
        visited = []
        while True:
            try:
                return cls.connect(host, port, tenant, credential, tls=tls)
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
                host, _, redirect_port = e.redirect.rpartition(":")
                port = int(redirect_port)

    def _answer(self, builder, request_type, body, answer_type, table):
        """Sends a request and reads its answer as `table` (a generated class); an answer of
        another type than `answer_type` raises Unexpected."""
        frame = self._call(builder, request_type, body)
        if frame.BodyType() != answer_type:
            what = REQUEST_NAMES.get(request_type, request_type)
            raise SpindleError("Unexpected", f"answer type {frame.BodyType()} to {what}")
        answer = table()
        answer.Init(frame.Body().Bytes, frame.Body().Pos)
        return answer

    def _call(self, builder, body_type, body):
        request_id = self.next_id
        self.next_id += 1
        RequestFrame.Start(builder)
        RequestFrame.AddRequestId(builder, request_id)
        RequestFrame.AddBodyType(builder, body_type)
        RequestFrame.AddBody(builder, body)
        root = RequestFrame.End(builder)
        builder.Finish(root, file_identifier=IDENTIFIER)
        payload = bytes(builder.Output())
        self.sock.sendall(struct.pack("<I", len(payload)) + payload)
        frame = self._read_frame()
        # A subscription's events come on its Subscribe's request id, in between answers (even
        # before the Subscribe's own): kept for next_event.
        while frame.BodyType() == Response.Response.Event:
            self._keep(frame)
            frame = self._read_frame()
        # Request id 0 is the connection's: the node's last word before it closes it (a
        # framing error, or the tenant suspended by the breaker), raised as it is.
        if frame.RequestId() not in (request_id, 0):
            raise SpindleError("Unexpected", f"answer to {frame.RequestId()}, not {request_id}")
        _raise_error(frame)
        return frame

    def _read_exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise SpindleError("Closed", "the node closed the connection")
            data += chunk
        return data

    def _read_frame(self):
        (length,) = struct.unpack("<I", self._read_exact(4))
        if length == 0 or length > FRAME_BYTES_MAX:
            raise SpindleError("FrameTooLarge", f"frame of {length} bytes")
        payload = self._read_exact(length)
        if payload[4:8] != IDENTIFIER:
            raise SpindleError("BadIdentifier", repr(payload[4:8]))
        return ResponseFrame.ResponseFrame.GetRootAs(payload, 0)

    def submit(self, key, user, model, width, height, duration_ms, fps, audio=False,
               references=0, band_hint=0, input=None):
        """Submits one task; its admission as a dict (task_id, decision — 0 is accepted —,
        replay, reason). `input`: what to generate, for the provider — a dict/list (sent as
        JSON) or a JSON text, at most 16 KiB."""
        b = flatbuffers.Builder(256)
        body = _submit_task(b, key, user, model, width, height, duration_ms, fps, audio,
                            references, band_hint, input)
        return _admission(self._answer(b, Request.Request.SubmitTask, body,
                                       Response.Response.Admission, Admission.Admission))

    def submit_retrying(self, tries=5, **task):
        """Submits one task (submit's arguments by name), sending it again while the node
        refuses it for its load (REJECT_PLATFORM_OVERLOADED), each time after the admission's
        retry_after_ms (at least 1 ms), at most `tries` times; the last admission."""
        for _ in range(max(1, tries) - 1):
            a = self.submit(**task)
            if a["decision"] != REJECT_PLATFORM_OVERLOADED:
                return a
            time.sleep(max(a["retry_after_ms"], 1) / 1000)
        return self.submit(**task)

    def submit_batch(self, tasks):
        """Submits 1..=BATCH_MAX tasks in one frame, each a dict of submit's arguments; their
        admissions in order (one group commit for all that are accepted)."""
        if not 1 <= len(tasks) <= BATCH_MAX:
            raise SpindleError("BatchTooLarge",
                               f"a batch holds 1..={BATCH_MAX} tasks, not {len(tasks)}")
        b = flatbuffers.Builder(256 * len(tasks))
        offsets = [_submit_task(b, **t) for t in tasks]
        SubmitBatch.StartTasksVector(b, len(offsets))
        for o in reversed(offsets):
            b.PrependUOffsetTRelative(o)
        vector = b.EndVector()
        SubmitBatch.Start(b)
        SubmitBatch.AddTasks(b, vector)
        body = SubmitBatch.End(b)
        r = self._answer(b, Request.Request.SubmitBatch, body,
                         Response.Response.SubmitBatchResult, SubmitBatchResult.SubmitBatchResult)
        return [_admission(r.Admissions(j)) for j in range(r.AdmissionsLength())]

    def get(self, task_id):
        b = flatbuffers.Builder(64)
        GetTask.Start(b)
        GetTask.AddTaskId(b, task_id)
        body = GetTask.End(b)
        s = self._answer(b, Request.Request.GetTask, body, Response.Response.TaskStatus,
                         TaskStatus.TaskStatus)
        return {
            "task_id": s.TaskId(),
            "state": STATE_NAMES.get(s.State(), str(s.State())),
            "attempt_no": s.AttemptNo(),
            "progress_pct": s.ProgressPct(),
            "result": json.loads(s.Result()) if s.Result() else None,
            # For a queued task its node holds: ms from this answer until it is expected to
            # start (0 otherwise).
            "expected_start_ms": s.ExpectedStartMs(),
        }

    def cancel(self, task_id):
        """Cancels a queued or running task of this tenant; answers its state, Canceled, once
        the cancel is stored (a task at the provider is asked to stop). A task that has ended,
        or no task of this tenant, raises NotFound."""
        b = flatbuffers.Builder(64)
        CancelTask.Start(b)
        CancelTask.AddTaskId(b, task_id)
        body = CancelTask.End(b)
        c = self._answer(b, Request.Request.CancelTask, body, Response.Response.Canceled,
                         Canceled.Canceled)
        return STATE_NAMES.get(c.State(), str(c.State()))

    def subscribe(self, task_id):
        """Asks for a live task's events (state, progress milestone, and with Succeeded its
        result); they come through next_event until the task ends. A task this node does not
        hold live (ended, or unknown) raises NotFound: read it with get."""
        b = flatbuffers.Builder(64)
        Subscribe.Start(b)
        Subscribe.AddTaskId(b, task_id)
        body = Subscribe.End(b)
        self._call(b, Request.Request.Subscribe, body)

    def next_event(self, timeout=None):
        """The next event of any subscription, as a dict (task_id, state, progress_pct,
        at_ms, result); None when none came within `timeout` seconds (None: wait)."""
        if self.events:
            return self.events.popleft()
        # Over TLS, bytes already decrypted wait in the socket's buffer where select cannot
        # see them.
        buffered = getattr(self.sock, "pending", lambda: 0)()
        if not buffered and not select.select([self.sock], [], [], timeout)[0]:
            return None
        frame = self._read_frame()
        if frame.BodyType() != Response.Response.Event:
            # The node's last word on the connection (request id 0), raised as it is.
            _raise_error(frame)
            raise SpindleError("Unexpected", f"answer type {frame.BodyType()} with no request")
        self._keep(frame)
        return self.events.popleft()

    def _keep(self, frame):
        if len(self.events) >= EVENTS_MAX:
            self.close()
            raise SpindleError(
                "EventsNotRead",
                f"more than {EVENTS_MAX} events held unread (read them with next_event); "
                "the connection is closed",
            )
        e = Event.Event()
        e.Init(frame.Body().Bytes, frame.Body().Pos)
        self.events.append({
            "task_id": e.TaskId(),
            "state": STATE_NAMES.get(e.State(), str(e.State())),
            "progress_pct": e.ProgressPct(),
            "at_ms": e.AtMs(),
            "result": json.loads(e.Result()) if e.Result() else None,
        })

    def close(self):
        self.sock.close()


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


def _fails_over(error):
    """Whether a request that failed with `error` is sent again on a fresh connection: the
    connection's end or a socket error (a timeout among them), or a node that cannot serve
    the tenant now. A wrong credential, a suspended tenant or a refused request is not."""
    if isinstance(error, SpindleError):
        return error.code in _FAILOVER_CODES
    return isinstance(error, OSError)


def _address(seed):
    host, sep, port = seed.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"seed {seed!r} is not host:port")
    return host, int(port)


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

        cluster = ClusterClient(["10.0.0.5:7470", "10.0.0.6:7470"], tenant=1,
                                credential="secret")
        admission = cluster.submit("order-17", user=3, model=0, width=1280, height=720,
                                   duration_ms=5000, fps=24)
    """

    def __init__(self, seeds, tenant, credential, failover_within=FAILOVER_WITHIN, tls=None):
        if not 1 <= len(seeds) <= SEEDS_MAX:
            raise ValueError(f"a cluster client takes 1..={SEEDS_MAX} seeds, not {len(seeds)}")
        self.seeds = [_address(seed) for seed in seeds]
        self.tenant = tenant
        self.credential = credential
        # Where the nodes' ports speak TLS: the ssl.SSLContext every connection uses.
        self.tls = tls
        self.failover_within = failover_within
        self.client = None
        # Connections replaced after a failure.
        self.failovers = 0
        # Tasks subscribed to and not yet ended, and ends read after a failover, given first.
        self.subscribed = set()
        self.caught_up = collections.deque()
        self.subscriptions_max = CLUSTER_SUBSCRIPTIONS_MAX
        self._call(lambda client: None)

    @property
    def node_id(self):
        """The node that serves the connection in use (connecting if none is)."""
        return self._call(lambda client: client.node_id)

    def submit(self, *args, **kwargs):
        """Client.submit, failing over (sent again with its idempotency key)."""
        return self._call(lambda client: client.submit(*args, **kwargs))

    def submit_batch(self, tasks):
        """Client.submit_batch, failing over (sent again whole, every key with it)."""
        return self._call(lambda client: client.submit_batch(tasks))

    def get(self, task_id):
        """Client.get, failing over."""
        return self._call(lambda client: client.get(task_id))

    def cancel(self, task_id):
        """Client.cancel, failing over (a cancel is stored once)."""
        return self._call(lambda client: client.cancel(task_id))

    def subscribe(self, task_id):
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

    def next_event(self, timeout=None):
        """The next event of any subscription, across failovers; None when none came within
        `timeout` seconds (None: wait)."""
        event = self._call(
            lambda client: self.caught_up.popleft() if self.caught_up
            else client.next_event(timeout)
        )
        if event is not None and event["state"] in TERMINAL_STATES:
            self.subscribed.discard(event["task_id"])
        return event

    def close(self):
        if self.client is not None:
            self.client.close()
            self.client = None

    def _resubscribe(self, client):
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

    def _call(self, request):
        deadline = time.monotonic() + self.failover_within
        pause = FAILOVER_PAUSE
        while True:
            try:
                return request(self._connection())
            except (OSError, SpindleError) as e:
                if not _fails_over(e):
                    raise
                failed = e
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

    def _connection(self):
        """The connection in use, or a new one: each seed in turn, following redirects; the
        last seed's failure if none serves."""
        if self.client is not None:
            return self.client
        failed = None
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
        raise failed
