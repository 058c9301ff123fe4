"""The HTTP transport (spruce.lang.http_endpoint) against an in-test HTTP server that answers
like `spruce serve`'s native routes: the API key header, errors with the server's message
and status, server-sent events (with an error mid-stream), and the abort of a stream the
caller stops reading."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

import spruce.lang as sl
from spruce.runtime.protocol.dsl import ChunkMsg, FinalMsg, GenerateMsg

KEY = "sesame"


class FakeNativeApi(BaseHTTPRequestHandler):
    """/model_info, /flush_cache, /abort_request, and /generate: the prompt reversed, one SSE
    event per character when streamed; the prompt "fail midway" errors after one event."""

    aborted: ClassVar[list[str]] = []  # rids of /abort_request calls, for the tests

    def do_GET(self) -> None:
        if self._authorized():
            self._json(200, {"model": "fake", "chat_template": None})

    def do_POST(self) -> None:
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            FakeNativeApi.aborted.append(body["rid"])
            self._json(200, {"aborted": 1})
        elif self.path == "/flush_cache":
            self._json(400, {"error": {"message": "cannot flush while requests run", "type": "x"}})
        elif body.get("stream"):
            self._stream(body)
        else:
            self._json(200, _result(body["text"]))

    def _stream(self, body: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        text = body["text"]
        for i, char in enumerate(text[::-1]):
            if text == "fail midway" and i == 1:
                self._event(
                    {
                        "index": 0,
                        "error": {
                            "message": "the scheduler is gone",
                            "type": "service_unavailable_error",
                        },
                    }
                )
                break
            meta = {"completion_tokens": i + 1, "output_token_logprobs": [[-0.5, i]]}
            self._event(
                {
                    "index": 0,
                    "text": char,
                    "output_ids": [i],
                    "finished": i == len(text) - 1,
                    "meta_info": meta,
                }
            )
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        try:
            self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
            self.wfile.flush()
        except OSError:
            pass  # the client stopped reading

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._json(
            401, {"error": {"message": "missing or wrong API key", "type": "authentication_error"}}
        )
        return False

    def _json(self, status: int, data) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def _result(text: str) -> dict:
    return {"text": text[::-1], "output_ids": [1], "meta_info": {"prompt_tokens": len(text)}}


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeNativeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def msg(text, **kwargs) -> GenerateMsg:
    return GenerateMsg(rid=sl.backend.new_rid(), text=text, **kwargs)


def test_the_api_key_is_sent_and_a_wrong_one_refused(url):
    endpoint = sl.RuntimeEndpoint(url, api_key=KEY)
    assert endpoint.model_info()["model"] == "fake" and endpoint.generate(msg("abc")).text == "cba"
    assert endpoint.ping() == endpoint.model_info()
    with pytest.raises(sl.RuntimeRequestError, match="wrong API key") as info:
        sl.RuntimeEndpoint(url, api_key="nope")
    assert info.value.status == 401 and info.value.address == url


def test_a_refusal_carries_the_servers_message_and_status(url):
    endpoint = sl.RuntimeEndpoint(url, api_key=KEY)
    with pytest.raises(sl.RuntimeRequestError, match="cannot flush while requests run") as info:
        endpoint.flush_cache()
    assert info.value.status == 400


def test_a_stream_gives_chunks_then_the_whole_result(url):
    events = list(sl.RuntimeEndpoint(url, api_key=KEY).generate_stream(msg("hello")))
    chunks, final = events[:-1], events[-1]
    assert (
        all(isinstance(c, ChunkMsg) for c in chunks) and "".join(c.text for c in chunks) == "olleh"
    )
    assert (
        isinstance(final, FinalMsg)
        and final.text == "olleh"
        and final.output_ids == [0, 1, 2, 3, 4]
    )
    assert final.meta_info["completion_tokens"] == 5  # counters: the latest chunk's
    assert [lp for lp, _ in final.meta_info["output_token_logprobs"]] == [
        -0.5
    ] * 5  # logprobs: concatenated


def test_an_error_inside_a_stream_is_raised_with_its_status(url):
    stream = sl.RuntimeEndpoint(url, api_key=KEY).generate_stream(msg("fail midway"))
    assert next(stream).text == "y"
    with pytest.raises(sl.RuntimeRequestError, match="the scheduler is gone") as info:
        next(stream)
    assert info.value.status == 503


def test_closing_a_stream_early_aborts_its_request(url):
    request = msg("a longer prompt to stream")
    stream = sl.RuntimeEndpoint(url, api_key=KEY).generate_stream(request)
    next(stream)
    stream.close()
    assert request.rid in FakeNativeApi.aborted


def test_a_closed_endpoint_refuses_requests(url):
    endpoint = sl.RuntimeEndpoint(url, api_key=KEY)
    endpoint.close()
    with pytest.raises(sl.RuntimeUnavailableError, match="closed"):
        endpoint.generate(msg("x"))


def test_sglangs_chat_template_name_is_refused_by_name(url):
    with pytest.raises(sl.UnsupportedFeatureError, match="chat_template_name='llama-2-chat'"):
        sl.RuntimeEndpoint(url, api_key=KEY, chat_template_name="llama-2-chat")


def test_close_releases_every_threads_session(url):
    endpoint = sl.RuntimeEndpoint(url, api_key=KEY)
    threads = [threading.Thread(target=endpoint.generate, args=(msg("ab"),)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(endpoint._sessions) == 4  # the creating thread's and three more
    endpoint.close()
    assert endpoint._sessions == []
