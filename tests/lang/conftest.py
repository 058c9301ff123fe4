"""Fixtures for the DSL tests that need a real server: one `spruce serve` on the tiny
random-weight model for the session (started by sl.Runtime, one CPU thread), reached over
both transports."""

from __future__ import annotations

import pytest

import spruce.lang as sl

TRANSPORTS = ("zmq", "http")


@pytest.fixture(scope="session")
def runtime(tiny_llama_dir):
    rt = sl.Runtime(str(tiny_llama_dir), num_threads=1, kv_memory_gb=0.25)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def http_endpoint(runtime):
    endpoint = sl.RuntimeEndpoint(runtime.url)
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="session", params=TRANSPORTS)
def endpoint(request, runtime):
    """The runtime over ZeroMQ (its own endpoint), then over HTTP: every test that takes
    `endpoint` runs on both transports."""
    if request.param == "zmq":
        return runtime.endpoint
    return request.getfixturevalue("http_endpoint")
