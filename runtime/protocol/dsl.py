"""The ZeroMQ protocol between DSL clients and a running `spruce serve`.

Transport: the client opens a DEALER socket to the server's ROUTER socket
(`tcp://127.0.0.1:<zmq-port>`, default 30001). A client message is an envelope of three
frames (`envelope`): the rid (UTF-8, at most MAX_RID_BYTES), the API key (empty without
one) and the body, a JSON object (orjson) with a "type" and the same client-chosen request
id "rid". The server reads the rid and checks the key and the body's size before it reads
the body. A server without --api-key also takes the body alone, as one frame. Server
messages are one frame: the JSON body. No pickle anywhere.

Client -> server, one message per call:
  {"type": "generate", "rid", "text" | "input_ids", "sampling_params": {...}, and the
   fields of RequestOptions (runtime/core/options.py: return_logprob, stream, timeout_s...)}
      text / input_ids may be a list (a batch); a batch is answered by one "final"
      message whose "results" holds one result per input (streaming a batch is an error).
      For a batch, sampling_params may also be a list (one dict per input).
      sampling_params holds SamplingParams' fields, at most one constraint among them:
      regex, json_schema, choices, ebnf (GBNF), lark (llguidance's Lark), structural_tag.
  {"type": "abort", "rid"}                 aborts the request with that rid
  {"type": "model_info", "rid"}            model name, context length, chat template
  {"type": "flush_cache", "rid"}           empties the prefix cache (refused while busy)

Server -> client, tagged with the request's rid:
  {"type": "chunk", "rid", "text", "output_ids", "meta_info"}   (stream=true: new text)
  {"type": "final", "rid", "text", "output_ids", "meta_info"}   (whole text; or "results")
  {"type": "info", "rid", ...}                                   (model_info / flush_cache)
  {"type": "error", "rid", "message", "status"}                  (status: an HTTP-like code)

Authentication: when the server runs with --api-key, every client message carries the key
in its envelope's second frame (sl.RuntimeEndpoint(address, api_key=...) does it). There
is no handshake: each message stands alone, so a client that reconnects (a new ZeroMQ
identity) needs no new hello. The key is compared in constant time before anything else of
the message is read; a missing or wrong key is answered by an error with status 401 (with
the envelope's rid; rid "" for a one-frame message, which a client takes as an error for
all its requests), sent only if the client's queue takes it at once. Without --api-key the
server only binds its ZeroMQ port to a loopback address, unless it is started with
--allow-unauthenticated-zmq. The key travels in clear text: beyond one machine, run the
port through a tunnel or a private network.

Details:
  - A streamed request gets chunks, then one final message (whole text, all output ids,
    full meta_info). A chunk's "text" / "output_ids" are what is new; its meta_info has the
    counters so far (prompt_tokens, completion_tokens, cached_tokens, finish_reason) and
    the logprobs of that chunk's tokens only (input logprobs ride on the first chunk).
  - An aborted request is answered by its final message, with what it generated so far and
    meta_info.finish_reason.type == "abort".
  - rids belong to the client (its DEALER identity): two clients may use the same rid, one
    client may not reuse a rid that is still in flight.
  - rids are namespaced per client (the server runs them as "z<identity>:<rid>"), so one
    client's rid never collides with another's.
  - error status: 400 bad request (the message says what to change), 401 missing or wrong
    api_key, 413 message too large, 429 too many requests in flight for this client (or
    more than --max-zmq-bytes-per-client bytes of messages), 503 the server is full
    (retry later), shutting down or the scheduler is gone, 500 an internal error. The
    server keeps serving after any of them. A message without a readable rid cannot be
    answered: it is dropped (and counted in /metrics,
    spruce_zmq_bad_frames_total{outcome="dropped"}; answered ones as outcome="answered",
    key failures as outcome="unauthorized").
  - Bounds: the server queues at most ROUTER_RCVHWM messages per client (then the client's
    sends wait); a frame over twice --max-request-bytes disconnects the client.
  - timeout_s: a deadline in seconds from arrival (default: the server's
    --request-timeout-s); past it the request is aborted (its final message says so).
  - A streamed request whose reader falls more than --max-stream-backlog messages behind
    is aborted with an error (the server does not buffer without bound).

The message classes below are the one definition of these shapes; `encode` / `decode`
are the only (de)serializers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

import orjson

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.errors import InvalidRequestError

MAX_MESSAGE_BYTES = 32 * 2**20
MAX_RID_BYTES = 256  # the envelope's rid frame


def _generate_fields() -> list[tuple]:
    """GenerateMsg's fields: the prompts and sampling, then every RequestOptions field (the
    one list of per-request options, flat on the wire, with its defaults), then the tag."""
    options = [(f.name, f.type, field(default=f.default)) for f in fields(RequestOptions)]
    return [
        ("rid", "str"),
        ("text", "str | list[str] | None", field(default=None)),
        ("input_ids", "list[int] | list[list[int]] | None", field(default=None)),
        ("sampling_params", "dict[str, Any] | list[dict[str, Any]]", field(default_factory=dict)),
        *options,
        ("type", "str", field(default="generate")),
    ]


def _options(msg: Any) -> RequestOptions:
    """The message's RequestOptions (as given: validation checks them)."""
    return RequestOptions(**{name: getattr(msg, name) for name in RequestOptions.field_names()})


GenerateMsg = make_dataclass(
    "GenerateMsg", _generate_fields(), slots=True, namespace={"options": _options}
)
GenerateMsg.__module__ = __name__
GenerateMsg.__doc__ = """A generate call: text or input_ids (one prompt or a batch), sampling_params
(SamplingParams' fields and SGLang's n; a list: one per prompt), and RequestOptions' fields.
`msg.options()` is the call's RequestOptions."""


@dataclass(slots=True)
class AbortMsg:
    rid: str
    type: str = "abort"


@dataclass(slots=True)
class ModelInfoMsg:
    rid: str
    type: str = "model_info"


@dataclass(slots=True)
class FlushCacheMsg:
    rid: str
    type: str = "flush_cache"


@dataclass(slots=True)
class ChunkMsg:
    rid: str
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    type: str = "chunk"


@dataclass(slots=True)
class FinalMsg:
    rid: str
    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None
    results: list[dict[str, Any]] | None = None  # for a batch
    type: str = "final"


@dataclass(slots=True)
class InfoMsg:
    rid: str
    info: dict[str, Any] = field(default_factory=dict)
    type: str = "info"


@dataclass(slots=True)
class ErrorMsg:
    rid: str
    message: str
    status: int = 400
    type: str = "error"


MESSAGE_TYPES = {
    cls.__dataclass_fields__["type"].default: cls
    for cls in (
        GenerateMsg,
        AbortMsg,
        ModelInfoMsg,
        FlushCacheMsg,
        ChunkMsg,
        FinalMsg,
        InfoMsg,
        ErrorMsg,
    )
}


CLIENT_TYPES = ("generate", "abort", "model_info", "flush_cache")


def encode(msg) -> bytes:
    return orjson.dumps(asdict(msg))


def envelope(msg, api_key: str | None = None) -> list[bytes]:
    """A client message's frames: [rid, api key (empty: none), body]."""
    rid = msg.rid.encode()
    if len(rid) > MAX_RID_BYTES:
        raise InvalidRequestError(f"a rid has at most {MAX_RID_BYTES} bytes")
    return [rid, (api_key or "").encode(), encode(msg)]


def envelope_rid(frame: bytes) -> str | None:
    """The rid of an envelope's first frame, or None when it is not a short UTF-8 string."""
    if len(frame) > MAX_RID_BYTES:
        return None
    try:
        return bytes(frame).decode("utf-8")
    except UnicodeDecodeError:
        return None


def decode(frame: bytes):
    """bytes -> message object; malformed input raises InvalidRequestError (never another
    error, whatever the bytes)."""
    data = _json_object(frame)
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise InvalidRequestError(f"unknown message type; known: {', '.join(MESSAGE_TYPES)}")
    if not isinstance(data.get("rid"), str):
        raise InvalidRequestError("every message needs a string 'rid'")
    if "api_key" in data:
        raise InvalidRequestError(
            "the API key travels in the message's envelope, not in its body (see protocol/dsl.py)"
        )
    cls = MESSAGE_TYPES[kind]
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        shown = sorted(name[:64] for name in unknown)[:5]
        raise InvalidRequestError(f"unknown field(s) {shown} in a {kind} message")
    return cls(**data)  # every field but rid has a default, and rid is there


def rid_of(frame: bytes) -> str | None:
    """The rid of a frame that could not be decoded, if it has a readable one."""
    try:
        data = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return None
    rid = data.get("rid") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) else None


def _json_object(frame: bytes) -> dict[str, Any]:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise InvalidRequestError("a message is one frame of bytes")
    if len(frame) > MAX_MESSAGE_BYTES:
        raise InvalidRequestError(f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        data = orjson.loads(frame)
    except orjson.JSONDecodeError as e:
        raise InvalidRequestError(f"message is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("a message is a JSON object")
    return data
