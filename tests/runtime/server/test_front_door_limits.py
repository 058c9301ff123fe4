"""The front doors (issue 28): the Host header, POST-only state changes, the connection cap
and the header deadline, tokenizing off the event loop, the ZeroMQ envelope (the key is
checked before a body is read), duplicate rids, and the API key from a file or the
environment. In-process where the rule lives in one class; one real server for the rest."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import orjson
import pytest
import zmq
import zmq.asyncio
from test_server import API_KEY, AUTH, free_port, start_server, stop_server

from spruce.runtime.config import ServerOptions
from spruce.runtime.limits import ServingLimits
from spruce.runtime.protocol import dsl

# -- the Host header -------------------------------------------------------------------------------


async def _status_for(guard, host: bytes | None) -> int:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard.app = app
    sent = []
    headers = [] if host is None else [(b"host", host)]
    scope = {"type": "http", "method": "GET", "path": "/server_info", "headers": headers}

    async def send(message):
        sent.append(message)

    await guard(scope, None, send)
    return sent[0]["status"]


@pytest.mark.parametrize(
    "bind,allowed,host,status",
    [("127.0.0.1", None, b"attacker.example:30000", 400), ("127.0.0.1", None, b"localhost:30000", 200),
     ("127.0.0.1", None, b"127.0.0.1:30000", 200), ("127.0.0.1", None, b"[::1]:30000", 200),
     ("127.0.0.1", None, b"LOCALHOST", 200), ("127.0.0.1", None, None, 200),
     ("127.0.0.1", None, b"localhost.attacker.example", 400), ("127.0.0.1", "a.example,b.example", b"b.example:1", 200),
     ("127.0.0.1", "a.example", b"c.example", 400), ("127.0.0.1", "*", b"c.example", 200),
     ("0.0.0.0", None, b"c.example:30000", 200), ("0.0.0.0", "a.example", b"c.example", 400),
     ("0.0.0.0", "a.example", b"a.example:8080", 200), ("10.0.0.5", None, b"10.0.0.5:30000", 200),
     ("::1", None, b"[::1]:30000", 200)],
)  # fmt: skip
def test_the_host_header_must_name_this_server(bind, allowed, host, status):
    from spruce.runtime.server.http.middleware import GuardMiddleware

    launcher = SimpleNamespace(draining=False)
    guard = GuardMiddleware(ServerOptions(host=bind, allowed_hosts=allowed), launcher)
    assert asyncio.run(_status_for(guard, host)) == status


# -- connections: the cap and the header deadline (uvicorn, as the launcher configures it) -------


class HeldApp:
    """Answers /hold only when released; anything else at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            self.held += 1
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _serve(app, limits: ServingLimits):
    import uvicorn

    from spruce.runtime.server.launch import http_config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(http_config(app, limits, grace_s=1))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


def test_connections_past_the_cap_get_503():
    async def main():
        app = HeldApp()
        server, task, port = await _serve(app, ServingLimits(max_connections=2))
        url = f"http://127.0.0.1:{port}"
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as a,
            httpx.AsyncClient(base_url=url, timeout=30) as b,
        ):
            held = [asyncio.ensure_future(a.get("/hold")), asyncio.ensure_future(b.get("/hold"))]
            while app.held < 2:  # two connections open, each with a request in flight
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                assert (await c.get("/other")).status_code == 503
            app.release.set()
            assert [(await h).status_code for h in held] == [200, 200]
        while server.server_state.connections:  # the server has seen them close
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await c.get("/other")).status_code == 200
        server.should_exit = True
        await task

    asyncio.run(main())


def test_a_connection_that_does_not_finish_its_headers_is_closed():
    async def main():
        server, task, port = await _serve(HeldApp(), ServingLimits(header_timeout_s=0.3))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /other HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        )  # half a header, then nothing
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server, unanswered
        writer.close()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port
        )  # a whole request is answered
        writer.write(b"GET /other HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), 30)).startswith(b"HTTP/1.1 200")
        writer.close()
        server.should_exit = True
        await task

    asyncio.run(main())


# -- /tokenize runs off the event loop --------------------------------------------------------


def test_tokenize_runs_off_the_event_loop(tiny_tokenizer):
    """While a /tokenize call is inside the tokenizer (held there), another route answers:
    the loop is free. Were it on the loop, the other request could not finish first."""
    from fastapi import FastAPI

    from spruce.runtime.core.validation import ModelLimits
    from spruce.runtime.server.http.sglang_routes import sglang_routes
    from spruce.runtime.server.native import ModelContext

    inside, release = threading.Event(), threading.Event()

    class HeldTokenizer:
        def encode(self, text, add_special_tokens=True):
            inside.set()
            release.wait(30)
            return tiny_tokenizer.encode(text)

    model = ModelContext(HeldTokenizer(), "m", "/m", ModelLimits(384, 1024))
    app = FastAPI()
    app.include_router(sglang_routes())
    app.state.server = SimpleNamespace(model=model)

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            tokenize = asyncio.ensure_future(
                client.post("/tokenize", json={"prompt": "hello " * 1000})
            )
            while not inside.is_set():
                await asyncio.sleep(0.01)
            assert (await client.get("/ping")).json() == {"ok": True}
            assert not tokenize.done()  # still inside the tokenizer
            release.set()
            assert (await tokenize).json()["count"] == len(tiny_tokenizer.encode("hello " * 1000))

    asyncio.run(main())


def test_a_full_pool_refuses_with_503():
    from spruce.runtime.server.request_manager import Refused
    from spruce.runtime.server.work_pool import WorkPool

    release = threading.Event()

    async def main():
        pool = WorkPool("test", threads=1, max_waiting=1)
        running = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refused, match="busy") as refused:
            await pool.run(lambda: None)
        assert refused.value.status == 503 and refused.value.retry_after_s == 1
        release.set()
        assert await asyncio.gather(*running) == [True, True]
        assert await pool.run(lambda: 7) == 7  # the slots came back
        pool.close()

    asyncio.run(main())


# -- ZeroMQ: the key before the body ----------------------------------------------------------


def test_a_keyless_peer_never_gets_a_body_read(monkeypatch):
    """Garbage, oversize and wrong-key messages: none reaches the decoder; a keyed client
    is served meanwhile."""
    from spruce.runtime.server import zmq_frontend
    from spruce.runtime.server.metrics import Metrics

    decoded = []
    real_decode = dsl.decode
    monkeypatch.setattr(
        zmq_frontend.protocol, "decode", lambda body: decoded.append(body) or real_decode(body)
    )
    model = SimpleNamespace(info=lambda: {"model": "fake"})
    metrics = Metrics()

    async def main():
        context = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{free_port()}"
        front = zmq_frontend.ZmqFrontend(context, address, max_request_bytes=1000, api_key="k")
        front.attach(None, model, metrics)
        serving = asyncio.ensure_future(front.serve_forever())
        peer = context.socket(zmq.DEALER)
        peer.connect(address)
        wrong = dsl.envelope(dsl.ModelInfoMsg("w"), api_key="wrong")
        for frames in (
            [b"\xff garbage"],
            [b"x" * 1500],
            [b"big", b"", b"x" * 1500],
            wrong,
            [b"a", b"b"],
        ):
            await peer.send_multipart(frames)
        await peer.send_multipart(dsl.envelope(dsl.ModelInfoMsg("ok"), api_key="k"))
        replies = []
        while not replies or replies[-1]["rid"] != "ok":
            replies.append(orjson.loads(await asyncio.wait_for(peer.recv(), 30)))
        assert replies[-1] == {"type": "info", "rid": "ok", "info": {"model": "fake"}}
        assert [(r["rid"], r["status"]) for r in replies[:-1]] == [
            ("", 401),
            ("", 401),
            ("big", 401),
            ("w", 401),
        ]
        serving.cancel()
        peer.close(linger=0)
        front.close()
        context.term()

    asyncio.run(main())
    assert len(decoded) == 1  # only the keyed client's message
    counts = metrics.exposition().decode()
    assert 'spruce_zmq_bad_frames_total{outcome="unauthorized"} 4.0' in counts
    assert 'spruce_zmq_bad_frames_total{outcome="dropped"} 1.0' in counts  # two frames: no envelope


# -- the API key from a file or the environment -----------------------------------------------


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from spruce.runtime.cli import build_parser, server_options
    from spruce.runtime.errors import SpruceError

    def options(*flags):
        return server_options(build_parser().parse_args(["serve", *flags]))

    monkeypatch.delenv("SPRUCE_API_KEY", raising=False)
    assert options().api_key is None
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert options("--api-key-file", str(key_file)).api_key == "from-file"
    monkeypatch.setenv("SPRUCE_API_KEY", "from-env")
    assert options().api_key == "from-env"
    assert options("--api-key", "argv").api_key == "argv"
    assert options("--api-key-file", str(key_file)).api_key == "from-file"
    with pytest.raises(SpruceError, match="not both"):
        options("--api-key", "a", "--api-key-file", str(key_file))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SpruceError, match="empty"):
        options("--api-key-file", str(tmp_path / "empty"))
    with pytest.raises(SpruceError, match="cannot read"):
        options("--api-key-file", str(tmp_path / "missing"))


def test_runtime_passes_the_key_in_the_environment_not_the_command_line(monkeypatch):
    import spruce.lang.launcher as launcher

    started = {}

    def popen(command, env, **kwargs):
        started.update(command=command, env=env)
        raise OSError("stop here")

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    monkeypatch.setenv("SPRUCE_API_KEY", "parent-key")
    with pytest.raises(OSError, match="stop here"):
        launcher.Runtime(api_key="secret-key")
    assert (
        not any("secret-key" in part for part in started["command"])
        and "--api-key" not in started["command"]
    )
    assert started["env"]["SPRUCE_API_KEY"] == "secret-key"


# -- the real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("front-door-limits")
    (folder / "key").write_text(API_KEY + "\n")
    extra = ("--api-key-file", str(folder / "key"), "--max-tokenize-chars", "1000")
    srv = start_server(tiny_llama_dir, folder / "server.log", *extra)
    yield srv
    assert stop_server(srv) == 0, srv.log()


def test_server_refuses_a_foreign_host_and_answers_its_own(server):
    port = server.url.rsplit(":", 1)[1]
    r = httpx.get(server.url + "/server_info", headers={**AUTH, "Host": f"attacker.example:{port}"})
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert (
            httpx.get(server.url + "/server_info", headers={**AUTH, "Host": host}).status_code
            == 200
        )


def test_flush_cache_is_post_only(server):
    r = httpx.get(server.url + "/flush_cache", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert "POST" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/flush_cache", headers=AUTH).status_code == 200


def test_tokenize_and_detokenize_have_size_caps(server):
    r = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "x" * 1001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "--max-tokenize-chars" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": [[1]] * 1_000_001})
    assert r.status_code == 400 and "--max-detokenize-ids" in r.json()["error"]["message"]
    assert (
        httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "hi"}).json()["count"]
        >= 1
    )


def test_a_rid_shared_by_a_single_and_a_batch_is_an_error_frame(server):
    """The batch's rid is claimed before its (constrained, so off-loop) preparation: the
    single request with the same rid gets a 400 frame, the batch its result."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(server.zmq_url)
    params = {"max_new_tokens": 3, "regex": "[ab]{3}"}
    batch = dsl.GenerateMsg("d", text=["x", "y"], sampling_params=params)
    single = dsl.GenerateMsg("d", text="z", sampling_params=params)
    try:
        sock.send_multipart(dsl.envelope(batch, API_KEY))
        sock.send_multipart(dsl.envelope(single, API_KEY))
        replies = [orjson.loads(sock.recv()) for _ in range(2) if sock.poll(30_000)]
    finally:
        sock.close(linger=0)
        context.term()
    assert [r["type"] for r in replies] == ["error", "final"], replies
    assert replies[0]["status"] == 400 and "already in flight" in replies[0]["message"]
    assert len(replies[1]["results"]) == 2
    assert httpx.get(server.url + "/health").status_code == 200


def test_keyed_dsl_client_works_beside_a_keyless_peer(server):
    import spruce.lang as sl

    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.connect(server.zmq_url)
    for frames in ([b"\x00" * 5000], [b"r", b"wrong", b"{}"], [b"r", b"", b"x" * 10_000]):
        peer.send_multipart(frames)
    endpoint = sl.RuntimeEndpoint(server.zmq_url, api_key=API_KEY)
    try:
        final = endpoint.generate(
            dsl.GenerateMsg("keyed", text="hi", sampling_params={"max_new_tokens": 2})
        )
        assert len(final.output_ids) == 2
    finally:
        endpoint.close()
        peer.close(linger=0)
        context.term()
    unauthorized = 'spruce_zmq_bad_frames_total{outcome="unauthorized"} 3.0'
    deadline = time.monotonic() + 30
    while unauthorized not in httpx.get(server.url + "/metrics", headers=AUTH).text:
        assert time.monotonic() < deadline, "the keyless peer's messages were not all refused"
        time.sleep(0.05)
    with pytest.raises(Exception, match="API key"):
        sl.RuntimeEndpoint(server.zmq_url, api_key="wrong", connect_timeout=5)
