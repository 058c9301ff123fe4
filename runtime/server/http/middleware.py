"""The outer ASGI layer of the HTTP server (see GuardMiddleware)."""

from __future__ import annotations

import hmac

from spruce.runtime.server.http.common import error_body
from spruce.runtime.server.native import too_large

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
ANY_INTERFACE = ("0.0.0.0", "::")


class GuardMiddleware:
    """The outer ASGI layer: the Host header must name this server (400 otherwise: a web page
    that rebinds its own DNS name to 127.0.0.1 still sends its name as Host); 503 while the
    model loads (`app` is None) and while the server drains; the API key on every route but
    /health (401); the body size limit (413); a POST
    body must be JSON, declared as `Content-Type: application/json` (415): that keeps a web
    page in another origin from posting to the server with a "simple" cross-site request
    (form or text/plain), which a browser sends without asking. The body is read here
    (bounded) and replayed to the app. CORS (--allowed-origins) is a layer outside this one."""

    def __init__(self, options, launcher) -> None:
        self.app = None  # set once the model is loaded
        self.expected = f"Bearer {options.api_key}".encode() if options.api_key else None
        self.max_bytes = options.max_request_bytes
        self.launcher = launcher
        self.hosts = allowed_hosts(options)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        if not self._host_allowed(headers.get(b"host")):
            message = "the Host header names another server; serve that name with --allowed-hosts"
            return await _send_error(send, 400, message, code="invalid_host")
        if self.launcher.draining:
            return await _send_error(send, 503, "the server is shutting down")
        if self.expected is not None and scope["path"] != "/health":
            if not self._key_given(headers):
                message = (
                    "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key'"
                )
                return await _send_error(send, 401, message, code="invalid_api_key")
        if self.app is None:
            return await _send_error(
                send, 503, "the model is still loading; retry when /health answers 200"
            )
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, too_large(self.max_bytes))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, self.max_bytes)
            if body is None:
                return await _send_error(send, 413, too_large(self.max_bytes))
            if not _declared_json(headers.get(b"content-type"), body):
                message = (
                    "send the request body as JSON with the header 'Content-Type: application/json'"
                )
                return await _send_error(send, 415, message, code="unsupported_media_type")
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _key_given(self, headers: dict) -> bool:
        """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`."""
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        x_api_key = b"Bearer " + headers.get(b"x-api-key", b"")
        return hmac.compare_digest(x_api_key, self.expected) or bearer

    def _host_allowed(self, host: bytes | None) -> bool:
        """No Host (HTTP/1.0) passes: browsers always send one."""
        return self.hosts is None or host is None or host_name(host) in self.hosts


def allowed_hosts(options) -> frozenset[str] | None:
    """The Host names the server answers to (None: any): localhost, the bound address and
    --allowed-hosts; `*` in --allowed-hosts, or a server bound to every interface without
    --allowed-hosts, takes any name (as most servers do: such a server is meant to be
    reached by names it cannot know)."""
    hosts = options.hosts
    if "*" in hosts or (not hosts and options.host in ANY_INTERFACE):
        return None
    bound = options.host.lower()
    return frozenset({*LOCAL_HOSTS, bound, f"[{bound}]", *hosts})


def host_name(host: bytes) -> str:
    """The name of a Host header, without its port: b"[::1]:30000" -> "[::1]"."""
    name = host.decode("latin-1").strip().lower()
    if name.startswith("["):
        return name.partition("]")[0] + "]"
    return name.partition(":")[0].rstrip(".")


def _declared_json(content_type: bytes | None, body: bytes) -> bool:
    """An empty body may come without a type (POST /flush_cache); anything else is JSON."""
    if content_type is None:
        return not body
    return content_type.split(b";")[0].strip().lower() == b"application/json"


async def _read_body(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: http.disconnect when the client goes away

    return replayed


async def _send_error(send, status: int, message: str, code: str | None = None) -> None:
    body = error_body(status, message, code=code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
