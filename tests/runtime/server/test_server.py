"""End-to-end tests of `spruce serve`: the real server in a subprocess with the tiny model,
driven through real clients (the openai package, httpx, a raw ZeroMQ DEALER socket).

One server for the whole session (started with --api-key, so every client sends it);
tests/test_server_lifecycle.py starts its own servers to kill them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import zmq

from spruce.runtime.core.request import FinishReason
from spruce.runtime.core.update import Finished

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 256 * 1024


# -- server process helpers (also used by test_server_lifecycle.py) -----------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    zmq_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    model_dir: Path, log_path: Path, *extra: str, timeout: float = 90.0, script: Path | None = None,
    env: dict | None = None,
) -> ServerProcess:  # fmt: skip
    """`spruce serve` on the model (or `script serve`: a script that patches the runtime
    before it calls the CLI), small and on free ports, once it answers /health."""
    port, zmq_port = free_port(), free_port()
    entry = [str(script)] if script is not None else ["-m", "spruce.runtime"]
    cmd = [
        sys.executable, *entry, "serve", "--model", str(model_dir), "--port", str(port),
        "--zmq-port", str(zmq_port), "--num-threads", "1", "--kv-memory-gb", "0.02", "--log-level", "info",
        *extra,
    ]  # fmt: skip
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(
        proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{zmq_port}", log_path
    )
    wait_healthy(server, timeout)
    return server


def wait_healthy(server: ServerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.proc.kill()
    raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{server.log()}")


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_server(server: ServerProcess, timeout: float = 30.0) -> int:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.send_signal(signal.SIGUSR1)  # the server prints its stacks into the log
            time.sleep(1)
            server.proc.kill()
            server.proc.wait(5)
    return server.proc.returncode


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    extra = (
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--throughput-log-s",
        "1",
    )
    srv = start_server(tiny_llama_dir, log_path, *extra)
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="session")
def model_name(tiny_llama_dir) -> str:
    return Path(tiny_llama_dir).name


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture()
def dealer(server):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(server.zmq_url)
    yield sock
    sock.close()
    context.term()


def zmq_send(sock, msg: dict, api_key: str | None = API_KEY) -> None:
    """Sends one message in its envelope (rid, the server's API key, body: protocol/dsl.py)."""
    sock.send_multipart([msg["rid"].encode(), (api_key or "").encode(), orjson.dumps(msg)])


def zmq_call(sock, msg: dict, api_key: str | None = API_KEY) -> list[dict]:
    """Sends one message; returns the replies up to the final / info / error one."""
    zmq_send(sock, msg, api_key)
    replies = []
    while True:
        reply = orjson.loads(sock.recv())
        replies.append(reply)
        if reply["type"] in ("final", "info", "error"):
            return replies


def greedy(max_tokens: int = 8, **extra) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def assert_healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# -- basics --------------------------------------------------------------------------------------


def test_health_model_info_and_models(server, http, client, model_name):
    health = httpx.get(server.url + "/health").json()  # no key needed
    assert health["status"] == "ok" and health["ready"] is True
    assert 0 <= health["heartbeat_age_s"] < health["scheduler_timeout_s"]
    info = http.get("/model_info").json()
    assert info["model"] == model_name and info["context_length"] == 1024
    assert "im_start" in info["chat_template"]
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]
)
def test_api_key_is_required(server, headers):
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/generate"),
        ("GET", "/metrics"),
        ("GET", "/server_info"),
    ):
        r = httpx.request(method, server.url + path, headers=headers, json={"text": "hi"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer" in r.json()["error"]["message"]


def test_openai_key_error_class(server, model_name):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


# -- OpenAI API ----------------------------------------------------------------------------------


def test_chat_completion(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        **greedy(6),
    )  # fmt: skip
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_cached_tokens_on_repeated_prompt(client, model_name):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    first = client.completions.create(model=model_name, prompt=prompt, **greedy(4))
    second = client.completions.create(model=model_name, prompt=prompt, **greedy(4))
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].text == first.choices[0].text  # greedy


def test_chat_stream_matches_non_stream_and_reports_usage(client, model_name):
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=model_name, messages=messages, **greedy(12))
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(12),
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )


def test_completion_stream_with_n(client, model_name):
    stream = client.completions.create(
        model=model_name, prompt="Once upon a time", n=2, stream=True, max_tokens=5, seed=1
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}


def test_n_choices_and_batch_prompts(client, model_name):
    r = client.completions.create(model=model_name, prompt=["a b c", "d e f"], n=2, **greedy(3))
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: same prompt, same text


def test_stop_string_trims_and_reports_stop(client, model_name):
    prompt = "What is the capital of France?"
    free = client.completions.create(model=model_name, prompt=prompt, **greedy(16)).choices[0].text
    stop = next((free[i : i + 2] for i in range(2, len(free) - 2) if free[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip("the greedy text has no usable stop string")
    r = client.completions.create(model=model_name, prompt=prompt, stop=[stop], **greedy(16))
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3,
        **greedy(5),
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(
            entry.top_logprobs[0].logprob, abs=1e-4
        )  # greedy: the top token


def test_completion_logprobs_and_echo(client, model_name):
    r = client.completions.create(
        model=model_name, prompt="hello world", logprobs=2, echo=True, **greedy(3)
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("hello world")
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_json_schema_response_format(client, model_name):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_tool_call(client, model_name, tool_choice):
    import jsonschema

    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": params}},
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=150, temperature=0,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, params)
    else:
        assert call.function.name == "get_time" and isinstance(arguments, dict)


def test_streamed_required_tool_call(client, model_name):
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False,
    }}}]  # fmt: skip
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "ping"}], tools=tools, tool_choice="required",
        parallel_tool_calls=False, stream=True, max_tokens=100, temperature=0,
    ))  # fmt: skip
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls if c.function.name] == ["ping"] and {
        c.index for c in calls
    } == {0}
    arguments = "".join(c.function.arguments or "" for c in calls)  # streamed piece by piece
    assert 0 <= json.loads(arguments)["n"] <= 9
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]


def test_generate_regex(http):
    import re

    params = {"regex": "[0-9]{3}-[a-z]{2}", "max_new_tokens": 20, "temperature": 0.8, "seed": 3}
    r = http.post("/generate", json={"text": ["Code:", "Id:"], "sampling_params": params})
    assert r.status_code == 200, r.text
    for result in r.json():
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", result["text"]), result["text"]


def test_tool_choice_validation(http, model_name):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and "tool_choice needs tools" in r.json()["error"]["message"]
    named = {"type": "function", "function": {"name": "g"}}
    r = http.post("/v1/chat/completions", json={**body, "tools": [tool], "tool_choice": named})
    assert r.status_code == 400 and "'g'" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={**body, "tools": [tool], "tool_choice": "auto"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


# -- native API ----------------------------------------------------------------------------------


def test_generate_single_batch_and_input_ids(http):
    one = http.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    )
    assert one.status_code == 200
    body = one.json()
    assert len(body["output_ids"]) == 4 and body["meta_info"]["finish_reason"]["type"] == "length"
    params = {"max_new_tokens": 3, "temperature": 0}
    batch = http.post("/generate", json={"text": ["Hello", "World"], "sampling_params": params})
    assert [len(b["output_ids"]) for b in batch.json()] == [3, 3]
    assert batch.json()[0]["output_ids"][:3] == body["output_ids"][:3]
    ids = http.post(
        "/generate", json={"input_ids": [10, 20, 30], "sampling_params": {"max_new_tokens": 2}}
    )
    assert ids.json()["meta_info"]["prompt_tokens"] == 3


def test_generate_logprobs(http):
    r = http.post("/generate", json={
        "text": "The capital of France", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
    }).json()  # fmt: skip
    meta = r["meta_info"]
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None


def sse_events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_stream(http):
    params = {"max_new_tokens": 6, "temperature": 0}
    whole = http.post("/generate", json={"text": "Stream me", "sampling_params": params}).json()
    with http.stream(
        "POST", "/generate", json={"text": "Stream me", "sampling_params": params, "stream": True}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert [c["finished"] for c in chunks][-1] is True and not any(
        c["finished"] for c in chunks[:-1]
    )


def test_server_info_metrics_and_flush(http):
    info = http.get("/server_info").json()
    stats = info["scheduler"]
    assert stats["kv_slots_total"] == info["kv_slots_total"] > 0
    for key in (
        "running_requests",
        "waiting_requests",
        "cache_tokens",
        "cached_prompt_tokens_total",
    ):
        assert key in stats
    assert info["server_options"]["api_key"] == "<set>"
    assert http.post("/flush_cache").json() == {"flushed": True}
    assert http.get("/server_info").json()["scheduler"]["cache_tokens"] == 0
    metrics = http.get("/metrics").text
    for name in (
        "spruce_requests_total{", "spruce_prompt_tokens_total", "spruce_generation_tokens_total",
        "spruce_cached_tokens_total", "spruce_time_to_first_token_seconds_bucket",
        "spruce_inter_token_latency_seconds_bucket", "spruce_running_requests", "spruce_waiting_requests",
        "spruce_kv_usage_ratio",
    ):  # fmt: skip
        assert name in metrics, name


def test_finished_requests_are_logged(server, http):
    http.post(
        "/generate",
        json={"text": "log me", "rid": "logged-request", "sampling_params": {"max_new_tokens": 2}},
    )
    deadline = time.monotonic() + 5
    while "finished logged-request: prompt" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "finished logged-request: prompt" in server.log()


# -- ZeroMQ protocol -----------------------------------------------------------------------------


def test_zmq_generate_stream_batch(dealer):
    params = {"max_new_tokens": 5, "temperature": 0}
    [final] = zmq_call(
        dealer, {"type": "generate", "rid": "g1", "text": "Hi there", "sampling_params": params}
    )
    assert final["type"] == "final" and final["rid"] == "g1" and len(final["output_ids"]) == 5
    assert final["meta_info"]["id"] == "g1"
    stream = {
        "type": "generate",
        "rid": "g2",
        "text": "Hi there",
        "sampling_params": params,
        "stream": True,
    }
    replies = zmq_call(dealer, stream)
    chunks, last = replies[:-1], replies[-1]
    assert {c["type"] for c in chunks} == {"chunk"} and last["type"] == "final"
    assert "".join(c["text"] for c in chunks) == last["text"] == final["text"]
    assert [t for c in chunks for t in c["output_ids"]] == final["output_ids"]
    batch_msg = {
        "type": "generate",
        "rid": "g3",
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": params,
    }
    [batch] = zmq_call(dealer, batch_msg)
    assert [len(r["output_ids"]) for r in batch["results"]] == [5, 5]


def test_zmq_model_info_flush_and_errors(dealer, model_name):
    [info] = zmq_call(dealer, {"type": "model_info", "rid": "m"})
    assert (
        info["type"] == "info"
        and info["info"]["model"] == model_name
        and info["info"]["context_length"] == 1024
    )
    [flushed] = zmq_call(dealer, {"type": "flush_cache", "rid": "f"})
    assert flushed == {"type": "info", "rid": "f", "info": {"flushed": True}}
    cases = [
        (
            {
                "type": "generate",
                "rid": "e1",
                "text": "x",
                "sampling_params": {"max_new_tokens": 5000},
            },
            "context length",
        ),
        (
            {"type": "generate", "rid": "e2", "text": "x", "sampling_params": {"bogus": 1}},
            "unknown sampling parameter",
        ),
        (
            {"type": "generate", "rid": "e3", "text": ["a", "b"], "stream": True},
            "streaming a batch",
        ),
        ({"type": "generate", "rid": "e4", "input_ids": [10**9]}, "token ids in"),
        ({"type": "nonsense", "rid": "e5"}, "unknown message type"),
        ({"type": "final", "rid": "e6"}, "server message"),
    ]
    for msg, text in cases:
        [error] = zmq_call(dealer, msg)
        assert error["type"] == "error" and error["rid"] == msg["rid"] and error["status"] == 400
        assert text in error["message"], error
    dealer.send_multipart(
        [b"", API_KEY.encode(), b"not json"]
    )  # no rid to answer: dropped (and counted)
    [info] = zmq_call(dealer, {"type": "model_info", "rid": "after"})
    assert info["type"] == "info" and info["rid"] == "after"
    [error] = zmq_call(dealer, {"type": "model_info", "rid": "k"}, api_key="wrong")
    assert error["status"] == 401 and "API key" in error["message"]


def test_zmq_abort(server, dealer, http):
    params = {"max_new_tokens": 900, "ignore_eos": True}
    msg = {
        "type": "generate",
        "rid": "long",
        "text": "go",
        "sampling_params": params,
        "stream": True,
    }
    zmq_send(dealer, msg)
    first = orjson.loads(dealer.recv())
    assert first["type"] == "chunk"
    zmq_send(dealer, {"type": "abort", "rid": "long"})
    while True:
        reply = orjson.loads(dealer.recv())
        if reply["type"] == "final":
            break
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert reply["meta_info"]["completion_tokens"] < 900
    assert_no_running(http)


def assert_no_running(http, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = http.get("/server_info").json()["scheduler"]
        if stats["running_requests"] == 0 and stats["cache_locked_tokens"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still hold KV slots: {stats}")


# -- disconnects and load ------------------------------------------------------------------------


def test_http_disconnect_mid_stream_frees_the_request(server, http):
    body = {
        "text": "disconnect me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        with c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert http.get("/server_info").json()["scheduler"]["running_requests"] == 1
    assert_no_running(http)  # the client left: the request was aborted, its slots unlocked
    r = http.get("/metrics").text
    assert 'spruce_requests_total{finish_reason="abort"}' in r


def test_http_disconnect_non_streaming_aborts(server, http):
    body = {"text": "wait for me", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=body, headers=AUTH, timeout=0.05)
    assert_no_running(http)


def test_100_concurrent_requests(server):
    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as c:

            async def one(i):
                params = {"max_new_tokens": 8, "ignore_eos": True}
                r = await c.post(
                    "/generate", json={"text": f"request {i}", "sampling_params": params}
                )
                return r.status_code, len(r.json()["output_ids"])

            return await asyncio.gather(*(one(i) for i in range(100)))

    results = asyncio.run(main())
    assert results == [(200, 8)] * 100


# -- bad input -----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUT = [
    # (path, body (dict, or bytes sent raw), status, text in the message)
    (CHAT, b"{not json", 400, "not valid JSON"),
    (CHAT, {"model": "{model}", "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "{model}", "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"model": "{model}", "messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    (CHAT, {"model": "{model}", "messages": []}, 400, "messages"),
    (CHAT, {"model": "gpt-9", "messages": MSG}, 404, "does not exist"),
    (
        CHAT,
        {"model": "{model}", "messages": MSG, "max_tokens": 5000},
        400,
        "lower max_tokens to at most",
    ),
    (
        CHAT,
        {"model": "{model}", "messages": MSG, "temperature": -1},
        400,
        "temperature must be >= 0",
    ),
    (CHAT, {"model": "{model}", "messages": MSG, "n": 0}, 400, "n must be an integer from 1"),
    (CHAT, {"model": "{model}", "messages": MSG, "frobnicate": 1}, 400, "unknown field"),
    (CHAT, {"model": "{model}", "messages": MSG, "top_logprobs": 2}, 400, "needs logprobs"),
    (
        CHAT,
        {
            "model": "{model}",
            "messages": MSG,
            "regex": "a",
            "response_format": {"type": "json_object"},
        },
        400,
        "at most one",
    ),
    (CHAT, {"model": "{model}", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    (
        "/v1/completions",
        {"model": "{model}", "prompt": "word " * 1100},
        400,
        "context is 1024 tokens",
    ),
    ("/v1/completions", {"model": "{model}", "prompt": [[]]}, 400, "prompt is empty"),
    (
        "/v1/completions",
        {"model": "{model}", "prompt": "x", "logprobs": 99},
        400,
        "logprobs must be",
    ),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ("/generate", {"text": "x", "sampling_params": {"stop": 5}}, 400, "stop"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": "many"}},
        400,
        "max_new_tokens",
    ),
    ("/generate", {"input_ids": [1, -3]}, 400, "token ids in"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one of"),
    ("/generate", {"text": "x", "frob": 1}, 400, "unknown field(s) ['frob']"),
    ("/generate", {"text": "x", "return_logprob": "yes"}, 400, "return_logprob"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", {"text": "x" * (MAX_REQUEST_BYTES + 10)}, 413, "--max-request-bytes"),
    ("/abort_request", {}, 400, "rid"),
]


@pytest.mark.parametrize(
    "path,body,status,text", BAD_INPUT, ids=[f"{p}:{t}" for p, _, _, t in BAD_INPUT]
)
def test_bad_input(server, http, model_name, path, body, status, text):
    if isinstance(body, dict):
        body = json.dumps(body).replace("{model}", model_name).encode()
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert text in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert_healthy(server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("regex", "(unclosed"),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    ],
)
def test_bad_constraint_is_a_400(server, http, field, value):
    r = http.post(
        "/generate", json={"text": "x", "sampling_params": {field: value, "max_new_tokens": 4}}
    )
    assert r.status_code == 400, r.text
    assert_healthy(server)


def test_body_size_limit_by_declared_length(server):
    """A huge Content-Length is refused before any of the body is read."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {API_KEY}\r\nContent-Length: {10**9}\r\n\r\n"
        s.sendall(head.encode())
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert_healthy(server)


def test_streaming_request_refused_up_front_gets_status(http, model_name):
    body = {"model": model_name, "messages": MSG, "stream": True, "max_tokens": 99999}
    r = http.post(CHAT, json=body)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# -- tool-call parsing (no server) ---------------------------------------------------------------


def test_parse_auto_tool_calls():
    """The default ("json") format: Hermes blocks or a whole JSON call (more formats and
    streaming in test_chat_formats.py)."""
    from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
    from spruce.runtime.server.openai.tool_stream import ToolCallStream, final_calls

    names, fmt = {"get_weather", "get_time"}, TOOL_CALL_FORMATS["json"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'  # fmt: skip
    content, calls = final_calls(fmt, text, names)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert final_calls(fmt, '[{"name": "get_time", "arguments": {}}]', names)[0] is None
    assert final_calls(fmt, '{"name": "unknown", "arguments": {}}', names) == (
        '{"name": "unknown", "arguments": {}}',
        [],
    )
    assert final_calls(fmt, "plain text", names) == ("plain text", [])
    stream = ToolCallStream(fmt, names)
    pieces = [stream.feed(p) for p in ("Let me ", "check.\n<tool", "_call>\n{", '"name": "get_time", "arguments": {}}', "</tool_call>")]  # fmt: skip
    assert "".join(content for content, _ in pieces) == "Let me check.\n"
    [[call]] = [deltas for _, deltas in pieces if deltas]
    assert call["function"] == {"name": "get_time", "arguments": "{}"} and stream.finish() == (
        "",
        [],
    )


def test_required_tool_schema_shape():
    from spruce.runtime.server.openai.tool_parsers import required_schema

    f = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    g = {"name": "g"}
    schema = required_schema([f, g], parallel=False)
    assert schema["minItems"] == schema["maxItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["const"] for b in branches] == ["f", "g"]
    assert branches[1]["properties"]["arguments"] == {"type": "object"}


# -- internal messages and the front end's detokenizer (no server) --------------------------------


def finished(reason: dict) -> Finished:
    return Finished(FinishReason(**reason), 0, 0.5, 0.1, 0.4)


def test_internal_messages_round_trip():
    """Typed both ways: the records come back as the same classes (tuples as tuples),
    equal to what was sent."""
    from spruce.constrained.spec import ConstraintSpec
    from spruce.runtime.core.options import RequestOptions
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.core.update import LogprobDelta, ReqUpdate
    from spruce.runtime.core.validation import ValidRequest
    from spruce.runtime.protocol.ipc import NewRequest, NewRequests, StepOutput, decode, encode

    constraint = ConstraintSpec("regex", "a+", "a+", unenforced=("x",), fallback={"w": 1})
    sampling = SamplingParams(max_new_tokens=4, stop=("a",), logit_bias={5: 1.5})
    valid = ValidRequest([1, 2, 3], sampling, RequestOptions(stream=True), constraint)
    back = decode(encode(NewRequests([NewRequest("r1", valid)])))
    assert back == NewRequests([NewRequest("r1", valid)])
    got = back.requests[0].request
    assert isinstance(got, ValidRequest) and isinstance(got.sampling, SamplingParams)
    assert got.sampling.stop == ("a",) and got.sampling.logit_bias == ((5, 1.5),)
    assert got.constraint.unenforced == ("x",) and hash(got.constraint) == hash(constraint)
    delta = LogprobDelta([[-0.5, 5]], [[[-0.5, 5]]], [[None, 1]], [None])
    update = ReqUpdate("r1", 1, [5], 2, delta, finished({"type": "stop", "matched": 5}))
    step = decode(encode(StepOutput([update], 1, 0)))
    assert step == StepOutput([update], 1, 0) and isinstance(
        step.updates[0].finished.reason, FinishReason
    )


def test_jump_forward_rewrite_reaches_the_text(tiny_tokenizer):
    """An update that rolls back ids already sent (jump-forward re-tokenized the tail)
    replaces them: the text is re-derived, and no text is sent twice."""
    from spruce.runtime.core.options import RequestOptions
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.core.update import ReqUpdate
    from spruce.runtime.core.validation import ValidRequest
    from spruce.runtime.server.request_manager import Call, RequestState

    ids = tiny_tokenizer.encode('{"name": "Alice", "age": 30}')
    call = Call(manager=None, tokenizer=tiny_tokenizer, size=1)
    valid = ValidRequest([1, 2], SamplingParams(), RequestOptions(stream=True), None)
    state = RequestState("r", "r", 0, call, valid)
    first = state.apply(ReqUpdate("r", 0, ids[:3], 0))
    retokenized = tiny_tokenizer.encode(tiny_tokenizer.decode(ids[:3]) + '"name"')
    done = finished({"type": "stop", "matched": None})
    last = state.apply(ReqUpdate("r", 2, retokenized[1:], 0, finished=done))
    assert first.text + last.text == tiny_tokenizer.decode(retokenized)
    assert last.finished and last.result["output_ids"] == retokenized
    assert last.result["meta_info"]["completion_tokens"] == len(retokenized)


def test_the_rollback_count_is_made_from_what_jump_forward_rewrote():
    from spruce.runtime.core.request import Req
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.core.update import Reporter

    req = Req("r", [1], SamplingParams(), output_ids=[5, 6, 7])
    reporter = Reporter(req)
    assert reporter.update().new_ids == [5, 6, 7]
    req.output_ids.append(8)
    update = reporter.update()
    assert (update.rollback, update.new_ids) == (0, [8])  # appended
    req.output_ids, req.rewritten_from = [5, 9, 10, 11, 12], 1  # jump-forward from index 1
    update = reporter.update()
    assert (update.rollback, update.new_ids) == (3, [9, 10, 11, 12])
    assert req.rewritten_from is None and reporter.update().new_ids == []


def test_constrained_tool_output_becomes_tool_calls():
    from spruce.runtime.server.openai.routes import ChatRequest, ToolPlan

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    named = ToolPlan.of(
        ChatRequest(**base, tool_choice={"type": "function", "function": {"name": "f"}})
    )
    assert named.schema["properties"]["name"] == {"const": "f"}
    content, calls = named.calls_from('{"name": "f", "arguments": {"a": 1}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    required = ToolPlan.of(ChatRequest(**base, tool_choice="required"))
    content, calls = required.calls_from(
        '[{"name": "f", "arguments": {}}, {"name": "f", "arguments": {"b": 2}}]'
    )
    assert content is None and [c["function"]["arguments"] for c in calls] == ["{}", '{"b": 2}']
    assert required.calls_from('[{"name": "f", "argu') == (
        '[{"name": "f", "argu',
        [],
    )  # cut by max_tokens
    assert ToolPlan.of(ChatRequest(**base, tool_choice="none")).schema is None


def test_an_abort_the_client_did_not_ask_for_is_an_error(tiny_tokenizer):
    """E.g. a constraint that fails to compile after admission: the caller gets an error."""
    from spruce.runtime.core.options import RequestOptions
    from spruce.runtime.core.sampling_params import SamplingParams
    from spruce.runtime.core.update import ReqUpdate
    from spruce.runtime.core.validation import ValidRequest
    from spruce.runtime.server.request_manager import Call, RequestState

    call = Call(manager=None, tokenizer=tiny_tokenizer, size=1)
    valid = ValidRequest([1, 2], SamplingParams(), RequestOptions(stream=False), None)
    state = RequestState("r", "r", 0, call, valid)
    finish = {"type": "abort", "matched": None, "message": "cannot compile constraint: bad regex"}
    event = state.apply(ReqUpdate("r", 0, [], 0, finished=finished(finish)))
    assert event.error == finish["message"] and event.status == 400 and state.done


def test_streamed_text_survives_jump_forward(http):
    """Jump-forward re-tokenizes the tail of constrained output: the streamed pieces still
    add up to the final text."""
    schema = {
        "type": "object", "additionalProperties": False, "required": ["a_rather_long_property_name", "flag"],
        "properties": {"a_rather_long_property_name": {"type": "integer", "minimum": 0, "maximum": 99},
                       "flag": {"type": "boolean"}},
    }  # fmt: skip
    body = {
        "text": "JSON:",
        "sampling_params": {"json_schema": schema, "max_new_tokens": 60, "temperature": 0},
    }
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = sse_events(r)[:-1]
    assert json.loads(whole["text"])["flag"] in (True, False)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert (
        chunks[-1]["meta_info"]["jump_forward_tokens"]
        == whole["meta_info"]["jump_forward_tokens"]
        > 0
    )
