"""Messages between the server's front end and its scheduler process.

Two one-way ZeroMQ channels over ipc:// sockets in a private (0700) temporary folder:
front end --PUSH/PULL--> scheduler and scheduler --PUSH/PULL--> front end. Every message
is one orjson frame of one dataclass below, tagged by its "type"; `encode` / `decode` are
the only (de)serializers. No pickle anywhere.

The scheduler answers with one `StepOutput` per step (not one message per request): the
news of every streaming request that got tokens and of every request that finished.
Non-streaming requests are reported once, when they finish.

With `--dp N` there are N schedulers (replicas), each with an inbox of its own; all push to
the one front-end socket, so every message a scheduler sends carries its `replica` index.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import orjson

# -- front end -> scheduler ----------------------------------------------------------------


@dataclass(slots=True)
class RequestSpec:
    """One tokenized, validated request (the front end splits batches and `n`):
    `SamplingParams.to_dict()`, `RequestOptions.to_dict()` and the constraint already
    converted to a regex (`ConstraintSpec.to_dict()`), so the scheduler re-checks nothing."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    options: dict[str, Any]
    constraint: dict[str, str] | None = None


@dataclass(slots=True)
class NewRequests:
    requests: list[RequestSpec]
    type: str = "new_requests"

    def __post_init__(self) -> None:
        self.requests = [
            r if isinstance(r, RequestSpec) else RequestSpec(**r) for r in self.requests
        ]


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
    replica: int = 0  # the sender (--dp)
    type: str = "ready"


@dataclass(slots=True)
class StartupFailed:
    message: str
    replica: int = 0  # the sender (--dp)
    type: str = "startup_failed"


@dataclass(slots=True)
class ReqUpdate:
    """News of one request. Its output ids are now `ids_sent[:keep] + new_ids` (keep is
    below the count already sent only when jump-forward re-tokenized the tail)."""

    rid: str
    keep: int
    new_ids: list[int]
    cached_tokens: int
    finish: dict[str, Any] | None = None  # FinishReason.to_dict(), once finished
    logprobs: dict[str, list] | None = None  # streaming: the entries new since the last update
    meta_info: dict[str, Any] | None = None  # once finished: the full meta_info(req)
    first_token_s: float | None = None  # once finished: admission -> first token
    decode_s: float | None = None  # once finished: first token -> finish


@dataclass(slots=True)
class StepOutput:
    updates: list[ReqUpdate]
    num_running: int
    num_waiting: int
    replica: int = 0  # the sender (--dp)
    type: str = "step_output"

    def __post_init__(self) -> None:
        self.updates = [u if isinstance(u, ReqUpdate) else ReqUpdate(**u) for u in self.updates]


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
_FIELDS = {name: {f.name for f in fields(cls)} for name, cls in MESSAGE_TYPES.items()}


def encode(msg) -> bytes:
    return orjson.dumps(msg)  # orjson serializes (nested, slotted) dataclasses natively


def decode(frame: bytes):
    """Both ends are this code, over a private socket: a bad frame is a bug, so assert."""
    data = orjson.loads(frame)
    kind = data.get("type")
    assert kind in MESSAGE_TYPES and set(data) <= _FIELDS[kind], f"bad internal message {kind!r}"
    return MESSAGE_TYPES[kind](**data)
