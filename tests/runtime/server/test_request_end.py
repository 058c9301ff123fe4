"""Every request ends (issue 28): a request whose final update cannot be built, in the
scheduler process (its finish report raising, as `json.loads` of a 4,400-digit integer did)
or in the front end, still gets a final error naming no internals, and releases its slot in
/server_info and its client's count; a scheduler whose step is stuck makes /health fail, its
requests end with an error and new ones are refused until it answers again.

The faults are injected into a real server (its script patches the code it runs, in the front
end and in the spawned scheduler process alike), next to a stream that must finish with the
tokens it gives alone."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import stream_ids
from test_server import start_server, stop_server

HANG = [7, 7, 7, 7, 7, 7, 7]  # a prompt whose forward pass blocks while the flag file exists
FRONT_END_BOOM = (
    "front-end-boom"  # a stop string whose request fails in the front end's detokenizing
)
SCHEDULER_TIMEOUT_S = 10
STREAM = {
    "input_ids": list(range(20, 40)),
    "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
}
INTEGER_SCHEMA = {
    "max_new_tokens": 8,
    "temperature": 0,
    "json_schema": {"type": "integer", "minimum": 1},
}

FAULTY_SERVE = f"""
import os, sys, time
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests share two cores among processes
import spruce.runtime.server.scheduler_process as scheduler_process
from spruce.runtime.executor.model_runner import ModelRunner
from spruce.runtime.server.request_manager import RequestState

real_update = scheduler_process.Reporter.update

def update(self):  # the finish report of a JSON-schema request raises, as the 4,400-digit integer did
    if self.req.constraint is not None and self.req.finished:
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion: value has 4400 digits")
    return real_update(self)

scheduler_process.Reporter.update = update

forward = ModelRunner.forward

def stuck_forward(self, items):
    if any(list(item.new_ids[:{len(HANG)}]) == {HANG} for item in items):
        while os.path.exists(os.environ["SPRUCE_TEST_HANG_FLAG"]):
            time.sleep(0.05)
    return forward(self, items)

ModelRunner.forward = stuck_forward

apply = RequestState.apply

def broken_apply(self, update):
    if update.finished is not None and "{FRONT_END_BOOM}" in self.output.text.stops:
        raise RuntimeError("injected: the front end could not finish this request")
    return apply(self, update)

RequestState.apply = broken_apply

if __name__ == "__main__":
    from spruce.runtime.cli import main
    sys.exit(main())
"""


@pytest.fixture(scope="module")
def hang_flag(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hang") / "stuck"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, hang_flag):
    folder = tmp_path_factory.mktemp("request-end")
    script = folder / "faulty_serve.py"
    script.write_text(textwrap.dedent(FAULTY_SERVE))
    extra = ("--max-requests-per-client", "2", "--scheduler-timeout-s", str(SCHEDULER_TIMEOUT_S))
    env = {**os.environ, "SPRUCE_TEST_HANG_FLAG": str(hang_flag)}
    srv = start_server(tiny_llama_dir, folder / "server.log", *extra, script=script, env=env)
    yield srv
    hang_flag.unlink(missing_ok=True)
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def alone(client) -> list[int]:
    return stream_ids(client, STREAM)


def beside_a_stream(client: httpx.Client, alone: list[int], action) -> None:
    """Runs `action()` while the stream runs; the stream gives the tokens it gives alone."""
    started, streamed = threading.Event(), {}
    thread = threading.Thread(
        target=lambda: streamed.update(ids=stream_ids(client, STREAM, started))
    )
    thread.start()
    try:
        assert started.wait(60)
        action()
    finally:
        thread.join(120)
    assert streamed["ids"] == alone and len(alone) == 200


def assert_every_slot_released(client: httpx.Client) -> None:
    assert client.get("/server_info").json()["in_flight_requests"] == 0
    # --max-requests-per-client 2: a leaked slot of this client would refuse two more with 429
    both = client.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    )
    assert both.status_code == 200, both.text
    assert client.get("/health").status_code == 200


def assert_clean_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert words in message
    for internal in ("4300", "ValueError", "RuntimeError", "injected", "Traceback", ".py"):
        assert internal not in message, message


def test_a_finish_report_that_raises_ends_the_request_with_a_clean_error(client, alone):
    def action():
        bad = client.post("/generate", json={"text": "x", "sampling_params": INTEGER_SCHEMA})
        assert_clean_error(bad, 500, "internal error while finishing the request")

    beside_a_stream(client, alone, action)
    assert_every_slot_released(client)


def test_a_streamed_request_whose_finish_report_raises_ends_with_an_error_event(client):
    with client.stream(
        "POST", "/generate", json={"text": "x", "sampling_params": INTEGER_SCHEMA, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    if r.status_code == 200:  # chunks went out first: the error is the last event before [DONE]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: ") :])
        assert "internal error while finishing the request" in last["error"]["message"], lines
    else:
        assert r.status_code == 500
    assert_every_slot_released(client)


def test_a_front_end_failure_while_finishing_ends_the_request_with_a_clean_error(client, alone):
    def action():
        body = {"text": "x", "sampling_params": {"max_new_tokens": 4, "stop": [FRONT_END_BOOM]}}
        assert_clean_error(
            client.post("/generate", json=body), 500, "internal error while finishing the request"
        )

    beside_a_stream(client, alone, action)
    assert_every_slot_released(client)


def wait_for_health(client: httpx.Client, status: int, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get("/health")
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_a_stuck_scheduler_fails_health_and_its_requests_until_it_answers_again(client, hang_flag):
    hang_flag.touch()
    result = {}
    body = {"input_ids": HANG, "sampling_params": {"max_new_tokens": 4}}
    thread = threading.Thread(target=lambda: result.update(r=client.post("/generate", json=body)))
    thread.start()
    try:
        thread.join(120)  # the stuck request ends once the scheduler counts as stalled
        assert_clean_error(result["r"], 503, "stopped answering")
        assert_clean_error(client.get("/health"), 503, "stopped answering")
        refused = client.post(
            "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}
        )
        assert_clean_error(refused, 503, "--scheduler-timeout-s")
    finally:
        hang_flag.unlink(missing_ok=True)
        thread.join(120)
    assert wait_for_health(client, 200).status_code == 200
    assert_every_slot_released(client)
