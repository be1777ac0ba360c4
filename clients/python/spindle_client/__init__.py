"""spindle's Python client: `Client` (blocking), `AsyncClient` (asyncio) and `ClusterClient`
(blocking, failing over between a cluster's nodes) speak the node's FlatBuffers protocol —
submit, submit_batch, submit_retrying (honouring the node's retry hint), get, cancel,
subscribe and next_event. Errors the node answers raise `SpindleError` with the protocol's
error code."""

from spindle_client._protocol import (
    ACCEPTED,
    ACCEPTED_BEST_EFFORT,
    BATCH_MAX,
    EVENTS_MAX,
    REJECT_PLATFORM_OVERLOADED,
    TERMINAL_STATES,
    Admission,
    SpindleError,
    TaskEvent,
    TaskStatus,
    accepted,
)
from spindle_client.aio import AsyncClient
from spindle_client.client import CLUSTER_SUBSCRIPTIONS_MAX, Client, ClusterClient

__version__ = "0.1.0"

__all__ = [
    "ACCEPTED",
    "ACCEPTED_BEST_EFFORT",
    "BATCH_MAX",
    "CLUSTER_SUBSCRIPTIONS_MAX",
    "EVENTS_MAX",
    "REJECT_PLATFORM_OVERLOADED",
    "TERMINAL_STATES",
    "Admission",
    "AsyncClient",
    "Client",
    "ClusterClient",
    "SpindleError",
    "TaskEvent",
    "TaskStatus",
    "accepted",
]
