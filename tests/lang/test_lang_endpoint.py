"""RuntimeEndpoint, the ZeroMQ client, against an in-test ROUTER that speaks the protocol."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

import spruce.lang as sl
from spruce.lang.launcher import free_port
from spruce.runtime.protocol.dsl import (
    AbortMsg,
    ChunkMsg,
    ErrorMsg,
    FinalMsg,
    FlushCacheMsg,
    GenerateMsg,
    InfoMsg,
    ModelInfoMsg,
    decode,
    encode,
)  # fmt: skip


class FakeRouter:
    """Answers generate with the prompt reversed (a batch: one result each), streams it one
    character per chunk, refuses the regex "(", and answers out of order: replies are held
    until `hold` requests have arrived, then sent last-first."""

    def __init__(self, hold: int = 1) -> None:
        self.port = free_port()
        self.hold = hold
        self.aborted: list[str] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()

    def _loop(self) -> None:
        held = []
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *_, frame = self._sock.recv_multipart()  # the envelope: rid, api key, body
            msg = decode(frame)
            if isinstance(msg, GenerateMsg) and not msg.stream and self.hold > 1:
                held.append((identity, msg))
                if len(held) == self.hold:
                    for ident, m in reversed(held):
                        self._answer(ident, m)
                    held = []
                continue
            self._answer(identity, msg)

    def _answer(self, identity: bytes, msg) -> None:
        for reply in self._replies(msg):
            self._sock.send_multipart([identity, encode(reply)])

    def _replies(self, msg):
        if isinstance(msg, ModelInfoMsg):
            return [InfoMsg(msg.rid, {"model": "fake", "chat_template": None})]
        if isinstance(msg, FlushCacheMsg):
            return [InfoMsg(msg.rid, {"flushed": True})]
        if isinstance(msg, AbortMsg):
            self.aborted.append(msg.rid)
            return []
        if msg.sampling_params.get("regex") == "(":
            return [ErrorMsg(msg.rid, "invalid regex '(': missing )", 400)]
        if isinstance(msg.text, list):
            return [FinalMsg(msg.rid, results=[_result(t) for t in msg.text])]
        if msg.stream:
            chunks = [ChunkMsg(msg.rid, c, [0], {}) for c in msg.text[::-1]]
            return [*chunks, FinalMsg(msg.rid, **_result(msg.text))]
        return [FinalMsg(msg.rid, **_result(msg.text))]


def _result(text: str) -> dict:
    return {"text": text[::-1], "output_ids": [], "meta_info": {"prompt_tokens": len(text)}}


def generate_msg(text, **kwargs) -> GenerateMsg:
    return GenerateMsg(rid=kwargs.pop("rid", None) or sl.backend.new_rid(), text=text, **kwargs)


@pytest.fixture
def router():
    server = FakeRouter()
    yield server
    server.close()


def test_an_unreachable_runtime_fails_fast_naming_the_address():
    address = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(
        sl.RuntimeUnavailableError, match=f"no Spruce runtime answered at {address}"
    ) as info:
        sl.RuntimeEndpoint(address, connect_timeout=2)
    assert info.value.address == address


def test_model_info_generate_and_batch(router):
    endpoint = sl.RuntimeEndpoint(router.address.removeprefix("tcp://"))  # tcp:// is the default
    try:
        assert endpoint.model_info()["model"] == "fake" and endpoint.chat_template is None
        assert endpoint.generate(generate_msg("abc")).text == "cba"
        assert [r["text"] for r in endpoint.generate(generate_msg(["ab", "cd"])).results] == [
            "ba",
            "dc",
        ]
        endpoint.flush_cache()
    finally:
        endpoint.close()


def test_replies_reach_their_callers_whatever_the_order():
    server = FakeRouter(hold=8)
    endpoint = sl.RuntimeEndpoint(server.address)
    try:
        texts = [f"request {i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            out = list(pool.map(lambda t: endpoint.generate(generate_msg(t)).text, texts))
        assert out == [t[::-1] for t in texts]
    finally:
        endpoint.close()
        server.close()


def test_streaming_and_early_close_aborts(router):
    endpoint = sl.RuntimeEndpoint(router.address)
    try:
        events = list(endpoint.generate_stream(generate_msg("hello")))
        assert "".join(e.text for e in events[:-1]) == "olleh" and isinstance(events[-1], FinalMsg)
        msg = generate_msg("abandoned")
        stream = endpoint.generate_stream(msg)
        next(stream)
        stream.close()
        deadline = time.monotonic() + 2
        while msg.rid not in router.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert msg.rid in router.aborted
    finally:
        endpoint.close()


def test_a_refusal_carries_the_runtimes_message(router):
    endpoint = sl.RuntimeEndpoint(router.address)
    try:
        with pytest.raises(sl.RuntimeRequestError, match="invalid regex") as info:
            endpoint.generate(generate_msg("x", sampling_params={"regex": "("}))
        assert info.value.status == 400 and info.value.message == "invalid regex '(': missing )"
    finally:
        endpoint.close()


def test_a_closed_endpoint_refuses_requests(router):
    endpoint = sl.RuntimeEndpoint(router.address)
    endpoint.close()
    with pytest.raises(sl.RuntimeUnavailableError, match="closed"):
        endpoint.generate(generate_msg("x"))


def test_runtime_rejects_unknown_options_before_starting():
    with pytest.raises(sl.ProgramError, match="unknown runtime option"):
        sl.Runtime(kv_memory=1)
