"""Messages between the server's front end and its scheduler process.

Two one-way ZeroMQ channels over ipc:// sockets in a private (0700) temporary folder:
front end --PUSH/PULL--> scheduler and scheduler --PUSH/PULL--> front end. Every message
is one orjson frame of one dataclass below, tagged by its "type"; `encode` / `decode` are
the only (de)serializers (codec.py: decoded into the same typed records, nested ones
included: `ValidRequest`, `ReqUpdate`). No pickle anywhere.

The scheduler answers with one `StepOutput` per step (not one message per request): the
news of every streaming request that got tokens and of every request that finished.
Non-streaming requests are reported once, when they finish.

With `--dp N` there are N schedulers (replicas), each with an inbox of its own; all push to
the one front-end socket, so every message a scheduler sends carries its `replica` index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from spruce.runtime.core.update import ReqUpdate
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.protocol.codec import decode_as
from spruce.runtime.protocol.codec import encode as encode

# -- front end -> scheduler ----------------------------------------------------------------


@dataclass(slots=True)
class NewRequest:
    """One tokenized, validated request (the front end splits batches and `n`), as the
    validation boundary made it: the scheduler builds its `Req` from it and checks nothing."""

    rid: str
    request: ValidRequest
    client: str = ""  # the front end's client key (scheduler/prefill.py shares prefill per client)


@dataclass(slots=True)
class NewRequests:
    requests: list[NewRequest]
    type: str = "new_requests"


@dataclass(slots=True)
class AbortRequests:
    rids: list[str]
    message: str = "aborted by the client"
    type: str = "abort_requests"


@dataclass(slots=True)
class ControlRequest:
    """A round trip answered by a `ControlReply` with the same id.
    command: "ping" | "stats" | "flush_cache" | "shutdown"."""

    id: int
    command: str
    type: str = "control"


# -- scheduler -> front end ----------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """The model is loaded; what the front end needs to validate requests."""

    model_name: str
    model_path: str
    context_length: int
    vocab_size: int
    kv_slots: int
    config: dict[str, Any]
    hidden_size: int = 0  # the length of an embedding
    replica: int = 0  # the sender (--dp)
    type: str = "ready"


@dataclass(slots=True)
class StartupFailed:
    message: str
    replica: int = 0  # the sender (--dp)
    type: str = "startup_failed"


@dataclass(slots=True)
class StepOutput:
    updates: list[ReqUpdate]
    num_running: int
    num_waiting: int
    replica: int = 0  # the sender (--dp)
    type: str = "step_output"


# What a client is told when its request's final update could not be built or applied
# (the scheduler process or the front end logs the exception).
UPDATE_FAILED = "internal error while finishing the request (see the server log)"


@dataclass(slots=True)
class RequestFailed:
    """The scheduler refused or dropped a request (InvalidRequestError, ConstraintError...)."""

    rid: str
    message: str
    status: int = 400
    replica: int = 0  # the sender (--dp)
    type: str = "request_failed"


@dataclass(slots=True)
class ControlReply:
    id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    replica: int = 0  # the sender (--dp)
    type: str = "control_reply"


@dataclass(slots=True)
class Heartbeat:
    """The scheduler's loop is alive: sent every HEARTBEAT_S, busy or idle. The front end
    counts a scheduler it has not heard from for --scheduler-timeout-s as stalled."""

    replica: int = 0  # the sender (--dp)
    type: str = "heartbeat"


HEARTBEAT_S = 0.5

MESSAGE_TYPES = {
    cls.__dataclass_fields__["type"].default: cls
    for cls in (
        NewRequests, AbortRequests, ControlRequest,
        Ready, StartupFailed, StepOutput, RequestFailed, ControlReply, Heartbeat,
    )
}  # fmt: skip


def decode(frame: bytes):
    """Both ends are this code, over a private socket: a bad frame is a bug, so assert.
    Typed all the way down (codec.py): records, not dicts, and no second validation."""
    data = orjson.loads(frame)
    kind = data.get("type")
    assert kind in MESSAGE_TYPES, f"bad internal message {kind!r}"
    return decode_as(MESSAGE_TYPES[kind], data)
