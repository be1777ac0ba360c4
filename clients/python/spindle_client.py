"""A small synchronous Python client for spindle's protocol, built on the code flatc generates
from the same schema (schemas/fbs/spindle.fbs) and the flatbuffers runtime from PyPI.

    client = Client.connect("127.0.0.1", 7070, tenant=1, credential="secret")
    admission = client.submit("order-17", user=3, model=0, width=1280, height=720,
                              duration_ms=5000, fps=24)
    status = client.get(admission["task_id"])

Errors from the node raise SpindleError(code_name, message).
"""

import json
import os
import socket
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "generated"))

import flatbuffers  # noqa: E402
from spindle.wire import (  # noqa: E402
    Admission,
    Error,
    ErrorCode,
    GetTask,
    Hello,
    HelloOk,
    Request,
    RequestFrame,
    Response,
    ResponseFrame,
    SubmitTask,
    TaskSpec,
    TaskState,
    TaskStatus,
)

PROTOCOL_VERSION = 1
IDENTIFIER = b"SPDL"
FRAME_BYTES_MAX = 1 << 20


def _names(enum_class):
    return {v: k for k, v in vars(enum_class).items() if not k.startswith("_")}


ERROR_NAMES = _names(ErrorCode.ErrorCode)
STATE_NAMES = _names(TaskState.TaskState)


class SpindleError(Exception):
    def __init__(self, code, message, redirect=None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        # With WrongNode: "host:port" of the node that serves the tenant, when one is known.
        self.redirect = redirect


class Client:
    def __init__(self, sock):
        self.sock = sock
        self.next_id = 1
        # The node that serves this connection (its HelloOk).
        self.node_id = ""

    @classmethod
    def connect(cls, host, port, tenant, credential):
        client = cls(socket.create_connection((host, port), timeout=10))
        b = flatbuffers.Builder(256)
        cred = b.CreateString(credential)
        name = b.CreateString("spindle-python")
        Hello.Start(b)
        Hello.AddProtocolVersion(b, PROTOCOL_VERSION)
        Hello.AddTenantId(b, tenant)
        Hello.AddCredential(b, cred)
        Hello.AddClientName(b, name)
        body = Hello.End(b)
        frame = client._call(b, Request.Request.Hello, body)
        if frame.BodyType() != Response.Response.HelloOk:
            raise SpindleError("Unexpected", f"answer type {frame.BodyType()} to Hello")
        ok = HelloOk.HelloOk()
        ok.Init(frame.Body().Bytes, frame.Body().Pos)
        client.node_id = ok.NodeId().decode() if ok.NodeId() is not None else ""
        return client

    @classmethod
    def connect_cluster(cls, host, port, tenant, credential, redirects_max=4):
        """connect() through any node of a cluster: a node that does not serve the tenant
        answers WrongNode with the address of the one that does, and this follows it — at
        most redirects_max times, never twice to one address."""
        visited = []
        while True:
            try:
                return cls.connect(host, port, tenant, credential)
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
        # Request id 0 is the connection's: the node's last word before it closes it (a
        # framing error, or the tenant suspended by the breaker), raised as it is.
        if frame.RequestId() not in (request_id, 0):
            raise SpindleError("Unexpected", f"answer to {frame.RequestId()}, not {request_id}")
        if frame.BodyType() == Response.Response.Error:
            err = Error.Error()
            err.Init(frame.Body().Bytes, frame.Body().Pos)
            redirect = err.Redirect()
            raise SpindleError(
                ERROR_NAMES.get(err.Code(), str(err.Code())),
                err.Message().decode(),
                redirect.decode() if redirect is not None else None,
            )
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
        """`input`: what to generate, for the provider — a dict/list (sent as JSON) or a JSON
        text, at most 16 KiB."""
        b = flatbuffers.Builder(256)
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
        body = SubmitTask.End(b)
        frame = self._call(b, Request.Request.SubmitTask, body)
        a = Admission.Admission()
        a.Init(frame.Body().Bytes, frame.Body().Pos)
        return {
            "task_id": a.TaskId(),
            "decision": a.Decision(),
            "replay": a.Replay(),
            "reason": a.Reason().decode() if a.Reason() else None,
        }

    def get(self, task_id):
        b = flatbuffers.Builder(64)
        GetTask.Start(b)
        GetTask.AddTaskId(b, task_id)
        body = GetTask.End(b)
        frame = self._call(b, Request.Request.GetTask, body)
        s = TaskStatus.TaskStatus()
        s.Init(frame.Body().Bytes, frame.Body().Pos)
        return {
            "task_id": s.TaskId(),
            "state": STATE_NAMES.get(s.State(), str(s.State())),
            "attempt_no": s.AttemptNo(),
            "result": json.loads(s.Result()) if s.Result() else None,
        }

    def close(self):
        self.sock.close()
