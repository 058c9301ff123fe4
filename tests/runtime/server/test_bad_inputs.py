"""The bad-input table (issue 13): one server for the whole module, bad requests on every
API (native /generate, /v1/completions, /v1/chat/completions, raw ZeroMQ frames) and on
Engine.generate. Each is refused with a 4xx (or an error frame, or dropped when it has no
rid) whose message names the field, while a streaming request runs again and again in the
background: every one of its runs gives the tokens it gives alone, and afterwards the KV
pool is back at its idle level."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import zmq
from test_server import API_KEY, AUTH, start_server, stop_server

from spruce.runtime.protocol.dsl import rid_of

MAX_REQUEST_BYTES = 1024 * 1024
JSON = {"content-type": "application/json"}
ORIGIN = "https://app.example"
STREAM = {
    "text": "A long story:",
    "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True},
}


@dataclass
class Case:
    api: str  # generate | completions | chat | zmq | engine | http (raw body and headers)
    body: Any
    status: int | None  # None: a ZeroMQ frame without a readable rid, dropped
    field: str  # text the error message must contain: the field it is about
    headers: dict | None = None


def gen(**sampling) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **sampling}}


def zgen(rid: str, **fields) -> dict:
    return {"type": "generate", "rid": rid, "text": "hi", **fields}


OPTIONAL_PROPERTIES = {
    "type": "object",
    "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)},
}
DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}}

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BIG_TOOL = {"type": "function", "function": {"name": "f", "description": "x" * 70_000}}

CASES = [
    # -- native /generate
    Case("generate", gen(temperature=1e-40), 400, "temperature"),  # the issue's reproduction
    Case("generate", gen(temperature=-0.0001), 400, "temperature"),
    Case("generate", gen(top_p=1.0000001), 400, "top_p"),
    Case("generate", gen(top_k=10**30), 400, "top_k"),
    Case("generate", gen(seed=2**64), 400, "seed"),
    Case("generate", gen(seed=-1), 400, "seed"),
    Case("generate", gen(max_new_tokens=10**20), 400, "max_new_tokens"),
    Case("generate", gen(min_new_tokens=9), 400, "min_new_tokens"),
    Case("generate", gen(min_p="0.1"), 400, "min_p"),
    Case("generate", gen(frequency_penalty=2**70), 400, "frequency_penalty"),
    Case("generate", gen(repetition_penalty=1e-300), 400, "repetition_penalty"),
    Case("generate", gen(stop=["x"] * 100), 400, "stop"),
    Case("generate", gen(stop=["x" * 5000]), 400, "stop string"),
    Case("generate", gen(stop_token_ids=list(range(1000))), 400, "stop_token_ids"),
    Case("generate", gen(stop_token_ids=[10**12]), 400, "stop_token_ids"),
    Case("generate", gen(regex="(unclosed"), 400, "regex"),
    Case("generate", gen(stop_regex=r"(a)\1"), 400, "stop_regex"),
    Case("generate", gen(json_schema={"$schema": [1], "type": "integer"}), 400, "$schema"),
    Case("generate", gen(regex="a" * 210_000), 400, "regex has 210000 characters"),
    Case("generate", gen(json_schema="{not json"), 400, "json_schema"),
    Case("generate", gen(json_schema=OPTIONAL_PROPERTIES), 400, "json_schema has"),
    Case("generate", gen(json_schema=DEEP), 400, "json_schema is nested too deeply"),
    Case("generate", gen(choices=[]), 400, "choices"),
    Case("generate", gen(ignore_eos="yes"), 400, "ignore_eos"),
    Case("generate", {"text": 5}, 400, "text"),
    Case("generate", {"input_ids": []}, 400, "prompt is empty"),
    Case("generate", {"input_ids": [[1, 2]] * 300}, 400, "--max-batch-size"),
    Case("generate", {"input_ids": [1, 2**64]}, 400, "input_ids"),
    Case("generate", {"text": "word " * 5000}, 400, "context"),
    Case("generate", {"text": "word " * 100_000}, 400, "--max-prompt-bytes"),  # issue 51
    Case(
        "generate", {"input_ids": [[1, 2]] * 100}, 429, "--max-requests-per-client"
    ),  # 100 > 64 per client
    Case(
        "generate", {"input_ids": [[1, 2]] * 200}, 503, "--max-waiting-requests"
    ),  # 200 > 128 running + 0
    Case("completions", {"prompt": "hi", "n": 100}, 429, "prompts x n count each"),
    Case("generate", {"text": "hi", "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    Case("generate", {"text": "hi", "logprob_start_len": 10**30}, 400, "logprob_start_len"),
    Case(
        "generate",
        {
            "input_ids": [5] * 1000,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 20, "n": 100},
        },
        400,
        "--max-logprob-entries",
    ),  # 2.1M entries
    Case("generate", {"text": "hi", "timeout_s": -1}, 400, "timeout_s"),
    Case("generate", {"text": "hi", "timeout_s": "soon"}, 400, "timeout_s"),
    Case("generate", {"text": "hi", "stream": "yes"}, 400, "stream"),
    Case("generate", {"text": "hi", "sampling_params": "hot"}, 400, "sampling_params"),
    Case("generate", {"text": "hi", "sampling_params": []}, 400, "sampling_params"),
    Case("generate", {"text": "hi", "rid": 5}, 400, "rid"),
    # -- OpenAI completions and chat
    Case("completions", {"prompt": "hi", "temperature": 1e-30}, 400, "temperature"),
    Case("completions", {"prompt": "hi", "n": 10**6}, 400, "n must be"),
    Case("completions", {"prompt": []}, 400, "prompt"),
    Case("completions", {"prompt": ["x"] * 300}, 400, "--max-batch-size"),
    Case("completions", {"prompt": [3, 10**12]}, 400, "token ids"),
    Case("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    Case("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    Case("completions", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
    Case("completions", {"prompt": "hi", "stop": ["a"] * 50}, 400, "stop"),
    Case("completions", {"prompt": "hi", "timeout_s": 0}, 400, "timeout_s"),
    Case("completions", {"prompt": ["hi", "word " * 100_000]}, 400, "prompt[1] has"),
    Case("chat", {"temperature": 1e-40}, 400, "temperature"),
    Case("chat", {"top_p": -0.5}, 400, "top_p"),
    Case("chat", {"messages": []}, 400, "messages"),
    Case("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    Case("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    Case("chat", {"max_tokens": 2**64}, 400, "max_tokens"),
    Case("chat", {"n": 0}, 400, "n must be"),
    Case(
        "chat",
        {"messages": [{"role": "user", "content": "word " * 100_000}]},
        400,
        "--max-prompt-bytes",
    ),
    Case("chat", {"tools": [TOOL] * 100, "tool_choice": "auto"}, 400, "--max-tools"),
    Case("chat", {"tools": [BIG_TOOL]}, 400, "--max-tools-bytes"),
    Case("chat", {"functions": [TOOL["function"]] * 100}, 400, "functions"),
    Case(
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}},
        400,
        "$ref",
    ),
    # -- raw HTTP: content type, key, size
    Case("http", b'{"text": "hi"}', 415, "Content-Type", {"content-type": "text/plain", **AUTH}),
    Case(
        "http",
        b"text=hi",
        415,
        "Content-Type",
        {"content-type": "application/x-www-form-urlencoded", **AUTH},
    ),
    Case("http", b'{"text": "hi"}', 401, "API key", JSON),
    Case("http", b"{", 400, "not valid JSON", {**JSON, **AUTH}),
    Case(
        "http", b"[" + b" " * MAX_REQUEST_BYTES + b"]", 413, "--max-request-bytes", {**JSON, **AUTH}
    ),
    Case(
        "http", b'{"text": "hi"}', 400, "Host", {**JSON, **AUTH, "host": "attacker.example:30000"}
    ),  # DNS rebinding
    Case(
        "http",
        b'{"text": "hi"}',
        400,
        "Host",
        {**JSON, **AUTH, "host": "127.0.0.1.attacker.example"},
    ),
    Case(
        "http", b'{"text": "hi"}', 400, "Host", {**JSON, "host": "localhost.attacker.example:80"}
    ),  # before the key
    # -- ZeroMQ frames
    Case("zmq", b'{"type": [], "rid": "z-type"}', 400, "message type"),  # the issue's reproduction
    Case("zmq", b'{"type": "generate", "rid": "z-field", "frob": 1}', 400, "frob"),
    Case("zmq", zgen("z-temp", sampling_params={"temperature": 1e-40}), 400, "temperature"),
    Case("zmq", zgen("z-seed", sampling_params={"seed": 2**64}), 400, "seed"),
    Case("zmq", zgen("z-top", top_logprobs_num=99), 400, "top_logprobs_num"),
    Case("zmq", zgen("z-stream", stream="yes"), 400, "stream"),
    Case("zmq", zgen("z-timeout", timeout_s=-5), 400, "timeout_s"),
    Case("zmq", zgen("z-batch", text=["a", "b"], stream=True), 400, "streaming a batch"),
    Case(
        "zmq", [b"z-key", b"wrong", orjson.dumps(zgen("z-key"))], 401, "API key"
    ),  # frames: rid, key, body
    Case(
        "zmq", [b"z-big", b"wrong", b"x" * (MAX_REQUEST_BYTES + 1)], 401, "API key"
    ),  # the key before the size
    Case(
        "zmq",
        [b"z-big", API_KEY.encode(), b"x" * (MAX_REQUEST_BYTES + 1)],
        413,
        "--max-request-bytes",
    ),
    Case("zmq", [b"\xff\xfe garbage"], 401, "API key"),  # no envelope: no key, not read
    Case("zmq", [b"z-other", API_KEY.encode(), orjson.dumps(zgen("z-rid"))], 400, "envelope"),
    Case("zmq", {**zgen("z-old-key"), "api_key": API_KEY}, 400, "envelope"),
    Case("zmq", b'{"type": "generate", "rid": 5}', None, ""),
    Case("zmq", b"\xff\xfe not json", None, ""),
    Case("zmq", b"[1, 2, 3]", None, ""),
    # -- the offline Engine
    Case("engine", {"sampling_params": {"temperature": float("nan")}}, 400, "temperature"),
    Case("engine", {"sampling_params": {"top_p": float("inf")}}, 400, "top_p"),
    Case("engine", {"sampling_params": {"seed": 2**70}}, 400, "seed"),
    Case("engine", {"sampling_params": {"stop_token_ids": [10**20]}}, 400, "stop_token_ids"),
    Case("engine", {"top_logprobs_num": 50}, 400, "top_logprobs_num"),
    Case(
        "engine",
        {
            "prompt": None,
            "input_ids": [[5] * 1000] * 100,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 20},
        },
        400,
        "--max-logprob-entries",
    ),
    Case("engine", {"prompt": None, "input_ids": [[1, "a"]]}, 400, "input_ids"),
    Case("engine", {"prompt": ["x"] * 300}, 400, "--max-batch-size"),
    Case("engine", {"prompt": "word " * 100_000}, 400, "--max-prompt-bytes"),
]


def case_id(case: Case) -> str:
    return f"{case.api}:{case.field or 'dropped'}:{CASES.index(case)}"


# -- the server, the background stream ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("bad-inputs") / "server.log"
    extra = (
        "--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-requests-per-client", "64",
        "--max-waiting-requests", "0", "--allowed-origins", ORIGIN, "--max-tools", "64",
        "--max-tools-bytes", "65536",
    )  # fmt: skip
    srv = start_server(tiny_llama_dir, log_path, *extra)
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def model_name(tiny_llama_dir) -> str:
    return tiny_llama_dir.name


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def stream_tokens(url: str) -> list[int]:
    ids = []
    with httpx.stream(
        "POST", url + "/generate", json={**STREAM, "stream": True}, headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[len("data: ") :])["output_ids"]
    return ids


class Background(threading.Thread):
    """Runs the streaming request over and over until stopped; keeps every run's tokens."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.runs, self.errors = url, [], []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.runs.append(stream_tokens(self.url))
            except Exception as e:  # noqa: BLE001 - reported by the last test
                self.errors.append(repr(e))


def kv_slots_used(http) -> int:
    return http.get("/server_info").json()["scheduler"]["kv_slots_used"]


def flush_when_idle(http, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while http.post("/flush_cache").status_code != 200:
        assert time.monotonic() < deadline, "the server stayed busy"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def background(server, http):
    flush_when_idle(http)
    idle = kv_slots_used(http)
    alone = stream_tokens(server.url)
    thread = Background(server.url)
    thread.start()
    yield {"thread": thread, "alone": alone, "idle": idle}
    thread.stopping.set()
    thread.join(120)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from spruce.runtime import Engine

    with Engine(str(tiny_llama_dir), num_threads=1, kv_memory_gb=0.02) as e:
        yield e


@pytest.fixture(scope="module")
def dealer(server):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq_url)
    yield sock
    sock.close()
    context.term()


# -- the table -----------------------------------------------------------------------------------


def test_the_table_has_enough_cases():
    assert len(CASES) >= 40
    assert {c.api for c in CASES} == {"generate", "completions", "chat", "zmq", "engine", "http"}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bad_input(case, request, model_name):
    if case.api == "engine":
        return check_engine(case, request.getfixturevalue("engine"))
    request.getfixturevalue("background")  # the stream runs while the table does
    if case.api == "zmq":
        return check_zmq(case, request.getfixturevalue("dealer"), request.getfixturevalue("http"))
    status, error = post(case, request.getfixturevalue("http"), model_name)
    assert status == case.status, error
    assert case.field in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_a_native_error_names_its_field_as_param(http):
    status, error = post(Case("generate", gen(temperature=1e-40), 400, "temperature"), http, "")
    assert status == 400 and error["param"] == "temperature", error


def post(case: Case, http, model_name: str) -> tuple[int, dict]:
    r = send(case, http, model_name)
    if r.status_code in (429, 503):
        assert r.headers["retry-after"] == "1"
    return r.status_code, r.json()["error"]


def send(case: Case, http, model_name: str) -> httpx.Response:
    if case.api == "http":
        return httpx.post(
            str(http.base_url) + "/generate", content=case.body, headers=case.headers, timeout=60
        )
    if case.api == "generate":
        return http.post("/generate", json=case.body)
    if case.api == "completions":
        return http.post(
            "/v1/completions", json={"model": model_name, "max_tokens": 4, **case.body}
        )
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **case.body,
    }
    return http.post("/v1/chat/completions", json=body)


def zmq_frames(body: Any) -> list[bytes]:
    """A row's ZeroMQ frames: a list is sent as it is; a body goes in an envelope with the
    key and the rid it names (an empty rid when it names none)."""
    if isinstance(body, list):
        return body
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return [(rid_of(raw) or "").encode(), API_KEY.encode(), raw]


def check_zmq(case: Case, dealer, http) -> None:
    frames = zmq_frames(case.body)
    dropped_before = dropped_frames(http)
    dealer.send_multipart(frames)
    if case.status is None:  # no rid to answer: dropped, counted, and the socket still serves
        assert not dealer.poll(300), "a frame without a rid was answered"
        assert dropped_frames(http) == dropped_before + 1
        dealer.send_multipart(zmq_frames({"type": "model_info", "rid": "alive"}))
        assert dealer.poll(10_000) and orjson.loads(dealer.recv())["rid"] == "alive"
        return
    assert dealer.poll(10_000), "no error frame"
    reply = orjson.loads(dealer.recv())
    assert reply["type"] == "error" and reply["status"] == case.status, reply
    rid = frames[0].decode() if len(frames) == 3 else ""  # "" answers a message without an envelope
    assert reply["rid"] == rid and case.field in reply["message"], reply


def dropped_frames(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('spruce_zmq_bad_frames_total{outcome="dropped"}'):
            return float(line.split()[-1])
    return 0.0


def check_engine(case: Case, engine) -> None:
    from spruce.runtime.errors import InvalidRequestError

    call = {"prompt": "hi", "sampling_params": {"max_new_tokens": 4}} | case.body
    with pytest.raises(InvalidRequestError, match=case.field.replace("-", r"\-")):
        engine.generate(**call)


# -- afterwards ----------------------------------------------------------------------------------


def test_the_stream_was_unharmed_and_the_pool_is_idle(http, background):
    thread = background["thread"]
    deadline = time.monotonic() + 60
    while (
        not thread.runs and time.monotonic() < deadline
    ):  # at least one whole run during the table
        time.sleep(0.2)
    thread.stopping.set()
    thread.join(120)
    assert thread.errors == []
    assert thread.runs and all(run == background["alone"] for run in thread.runs), len(thread.runs)
    flush_when_idle(http)
    assert kv_slots_used(http) == background["idle"]
    assert http.get("/server_info").json()["in_flight_requests"] == 0


def test_the_issue_reproductions_hurt_only_the_offender(server, http):
    """After the table (the stream has stopped): the temperature 1e-40 request and the frame
    that used to kill the ZeroMQ front end get their errors; DSL clients are still served."""
    import spruce.lang as sl

    r = http.post("/generate", json=gen(temperature=1e-40))
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect(server.zmq_url)
    sock.send_multipart([b"x", API_KEY.encode(), b'{"type": [], "rid": "x"}'])
    assert sock.poll(10_000) and orjson.loads(sock.recv())["rid"] == "x"
    sock.close(linger=0)
    context.term()
    endpoint = sl.RuntimeEndpoint(server.zmq_url, api_key=API_KEY)
    try:
        from spruce.runtime.protocol.dsl import GenerateMsg

        final = endpoint.generate(
            GenerateMsg("after", text="hi", sampling_params={"max_new_tokens": 3})
        )
        assert len(final.output_ids) == 3
    finally:
        endpoint.close()
    with pytest.raises(Exception, match="API key"):
        sl.RuntimeEndpoint(server.zmq_url, api_key="wrong", connect_timeout=5)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# -- web basics ----------------------------------------------------------------------------------


def test_cors_only_for_the_allowed_origin(server):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(server.url + "/generate", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    evil = httpx.options(
        server.url + "/generate", headers={"Origin": "https://evil.example", **preflight}
    )
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    r = httpx.get(server.url + "/model_info", headers={"Origin": ORIGIN, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(server.url + "/model_info", headers={"Origin": "https://evil.example", **AUTH})
    assert "access-control-allow-origin" not in r.headers


def test_model_info_names_the_model_and_server_info_has_the_path(server, http, tiny_llama_dir):
    info = http.get("/model_info").json()
    assert info["model"] == tiny_llama_dir.name and str(tiny_llama_dir) not in json.dumps(info)
    [card] = http.get("/v1/models").json()["data"]
    assert str(tiny_llama_dir) not in json.dumps(card)
    assert http.get("/server_info").json()["model_path"] == str(tiny_llama_dir)
    assert httpx.get(server.url + "/server_info").status_code == 401  # the path is behind the key
    assert httpx.get(server.url + "/health").status_code == 200  # the one route without the key


def test_request_deadline_aborts_and_frees(http):
    body = {
        "text": "slow",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        "timeout_s": 0.5,
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "deadline" in reason["message"]
    assert r.json()["meta_info"]["completion_tokens"] < 900
    assert http.get("/server_info").json()["in_flight_requests"] == 0


def test_a_backtracking_stop_regex_answers_and_the_server_serves_on(http):
    """The issue's ReDoS reproduction: stop_regex is matched in linear time on the scheduler loop."""
    sampling = {"max_new_tokens": 64, "temperature": 0, "regex": "a{64}", "stop_regex": "(a+)+b"}
    r = http.post("/generate", json={"text": "x", "sampling_params": sampling})
    assert r.status_code == 200 and r.json()["text"] == "a" * 64
    plain = http.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert plain.status_code == 200 and plain.json()["meta_info"]["completion_tokens"] >= 1
