"""HttpEndpoint: the DSL's backend over the native HTTP API of a running `spruce serve`.

    backend = sl.RuntimeEndpoint("http://127.0.0.1:30000", api_key="...")   # the server's --port

The same interface, behaviour and errors as the ZeroMQ endpoint: a request is a
`GenerateMsg` posted to /generate (streamed as server-sent events), the answer a `FinalMsg`
(`results` for a batch) or `ChunkMsg`s and then one `FinalMsg`. An HTTP error status becomes
`RuntimeRequestError` with the server's message and status; no answer at all becomes
`RuntimeUnavailableError`. `requests` sessions are not thread-safe, so each thread has its
own (and so its own keep-alive connection).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import orjson
import requests

from spruce.lang.backend import Backend
from spruce.lang.errors import RuntimeRequestError, RuntimeUnavailableError, UnsupportedFeatureError
from spruce.runtime.protocol.dsl import ChunkMsg, FinalMsg, GenerateMsg

CONNECT_TIMEOUT_S = 3.0  # the model_info call when an endpoint is created
CONTROL_TIMEOUT_S = 60.0  # model_info, server_info, flush_cache, abort
_NOT_SENT = ("type",)  # GenerateMsg fields /generate does not take


class HttpEndpoint(Backend):
    """A running Spruce runtime reached over HTTP. Creating one reads /model_info and fails
    within `connect_timeout` seconds if nothing answers.

    api_key: sent as "Authorization: Bearer <key>" (the server's --api-key).
    verify: TLS verification for https:// (requests' `verify`: a CA bundle path or False).
    request_timeout: the most seconds to wait for a request's next bytes (None: no limit).
    liveness_check: called before each request; raises to give up (as for the ZeroMQ
    endpoint: a launcher uses it to notice that its runtime process died)."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        verify: bool | str | None = None,
        chat_template_name: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        request_timeout: float | None = None,
        liveness_check: Callable[[], None] | None = None,
    ) -> None:
        if chat_template_name is not None:
            raise UnsupportedFeatureError(
                f"RuntimeEndpoint(chat_template_name={chat_template_name!r}): Spruce uses the served "
                "model's own chat template (model_info's chat_template); leave it None"
            )
        self.address = address.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.request_timeout = request_timeout
        self._liveness_check = liveness_check
        self._local = threading.local()
        self._sessions: list[requests.Session] = []  # every thread's, closed together
        self._sessions_lock = threading.Lock()
        self._closed = False
        self._info = self._get("/model_info", connect_timeout)

    # -- the Backend interface --------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return dict(self._info)

    def generate(self, msg: GenerateMsg) -> FinalMsg:
        if msg.stream:
            raise ValueError("generate() takes non-streaming requests; use generate_stream()")
        body = self._post("/generate", _request_body(msg), self.request_timeout)
        if isinstance(body, list):
            return FinalMsg(msg.rid, results=body)
        return FinalMsg(msg.rid, **_result_fields(body))

    def generate_stream(self, msg: GenerateMsg) -> Iterator[ChunkMsg | FinalMsg]:
        msg.stream = True
        response = self._send(
            "POST", "/generate", _request_body(msg), self.request_timeout, stream=True
        )
        finished = False
        try:
            final = FinalMsg(msg.rid, text="", output_ids=[], meta_info={})
            for event in _sse_events(response):
                if "error" in event:
                    raise _request_error(event["error"], self.address)
                chunk = ChunkMsg(msg.rid, event["text"], event["output_ids"], event["meta_info"])
                _add_chunk(final, chunk)
                if chunk.text or chunk.output_ids:
                    yield chunk
                if event.get("finished"):
                    finished = True
                    yield final
                    return
            raise RuntimeUnavailableError(
                self.address, f"the stream from {self.address} ended before its request"
            )
        finally:
            response.close()
            if not finished:  # the consumer stopped early, or an error: free the runtime's slots
                self._abort(msg.rid)

    def flush_cache(self) -> None:
        self._post("/flush_cache", {}, CONTROL_TIMEOUT_S)

    def ping(self, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
        """The model_info, read again: raises RuntimeUnavailableError if nothing answers."""
        return self._get("/model_info", timeout)

    def get_server_info(self) -> dict[str, Any]:
        """The server's /server_info: model, engine configuration, options, scheduler stats."""
        return self._get("/server_info", CONTROL_TIMEOUT_S)

    def close(self) -> None:
        self._closed = True
        with self._sessions_lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.address!r})"

    # -- internals --------------------------------------------------------------------------

    def _get(self, path: str, timeout: float | None) -> Any:
        return self._send("GET", path, None, timeout).json()

    def _post(self, path: str, body: dict, timeout: float | None) -> Any:
        return self._send("POST", path, body, timeout).json()

    def _send(
        self, method: str, path: str, body: dict | None, timeout: float | None, stream: bool = False
    ):
        """One HTTP call; a refusal (status >= 400) raises RuntimeRequestError."""
        if self._closed:
            raise RuntimeUnavailableError(
                self.address, f"the connection to {self.address} is closed"
            )
        if self._liveness_check is not None:
            self._liveness_check()
        url = self.address + path
        data = None if body is None else orjson.dumps(body)
        try:
            response = self._session().request(
                method, url, data=data, timeout=(CONNECT_TIMEOUT_S, timeout), stream=stream
            )
        except requests.ConnectionError as e:
            raise RuntimeUnavailableError(
                self.address, _unreachable_message(self.address, e)
            ) from None
        except requests.Timeout:
            raise RuntimeUnavailableError(
                self.address, _silence_message(self.address, timeout)
            ) from None
        if response.status_code >= 400:
            error = _error_object(response)
            response.close()
            raise _request_error(error, self.address, response.status_code)
        return response

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Content-Type"] = "application/json"
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            if self.verify is not None:
                session.verify = self.verify
            with self._sessions_lock:
                self._sessions.append(session)
        return session

    def _abort(self, rid: str) -> None:
        try:
            self._post("/abort_request", {"rid": rid}, CONTROL_TIMEOUT_S)
        except (RuntimeUnavailableError, RuntimeRequestError):
            pass


def _request_body(msg: GenerateMsg) -> dict[str, Any]:
    return {k: v for k, v in asdict(msg).items() if k not in _NOT_SENT}


def _result_fields(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "text": result.get("text"),
        "output_ids": result.get("output_ids"),
        "meta_info": result.get("meta_info"),
    }


def _sse_events(response: requests.Response) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent-event stream, until `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield orjson.loads(data)


def _add_chunk(final: FinalMsg, chunk: ChunkMsg) -> None:
    """Grows the final message from a chunk, as the ZeroMQ server builds its own: the whole
    text and ids; counters from the latest chunk; logprob lists concatenated (a chunk holds
    only its own tokens' logprobs)."""
    final.text += chunk.text
    final.output_ids.extend(chunk.output_ids)
    for key, value in chunk.meta_info.items():
        if key.endswith("logprobs") and isinstance(value, list):
            final.meta_info.setdefault(key, []).extend(value)
        else:
            final.meta_info[key] = value


def _error_object(response: requests.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"message": response.text or response.reason}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {"message": str(body)}


def _request_error(
    error: dict[str, Any], address: str, status: int | None = None
) -> RuntimeRequestError:
    status = status or error.get("status") or _status_of(error.get("type"))
    return RuntimeRequestError(str(error.get("message")), status, address)


def _status_of(error_type: str | None) -> int:
    """The status of an error event inside a stream (the event carries only its type)."""
    return {"service_unavailable_error": 503, "internal_server_error": 500}.get(
        error_type or "", 400
    )


def _unreachable_message(address: str, error: Exception) -> str:
    return (
        f"no Spruce runtime answered at {address} ({type(error).__name__}); start one with "
        f"`spruce serve --port <port>` (or `python -m spruce.runtime serve`), or launch one "
        f"from Python with sl.Runtime()"
    )


def _silence_message(address: str, timeout: float | None) -> str:
    return f"the Spruce runtime at {address} did not answer within {timeout:g} s"
