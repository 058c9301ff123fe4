"""Runtime: starts a local `spruce serve` process for DSL programs and stops it again.

runtime = sl.Runtime()                 # the bundled SmolLM2-135M-Instruct
sl.set_default_backend(runtime)
...
runtime.shutdown()                     # also done at interpreter exit
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Any

from spruce.lang.backend import new_rid
from spruce.lang.endpoint import RuntimeEndpoint
from spruce.lang.errors import ProgramError, RuntimeUnavailableError, UnsupportedFeatureError
from spruce.lang.http_endpoint import HttpEndpoint
from spruce.lang.sglang_options import translate_sglang_options
from spruce.runtime.cli import API_KEY_ENV, api_key_of
from spruce.runtime.config import ServerOptions, known_options
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.protocol.dsl import FinalMsg, GenerateMsg
from spruce.runtime.text.tokenizer import Tokenizer

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 15.0
_LOG_TAIL_CHARS = 3000


class Runtime:
    """A `spruce serve` subprocess on free ports (or the ones given), ready when the
    constructor returns; `.endpoint` is its RuntimeEndpoint.

    options: engine options (num_threads=1, kv_memory_gb=1, disable_radix_cache=True...) and
    server options (host, port, zmq_port...), as the `spruce serve` flags take them; SGLang's
    server options are translated (mem_fraction_static, random_seed...: see
    spruce.lang.sglang_options). The process's output goes to `log_path` (a temporary file
    unless given)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        log_path: str | None = None,
        **options: Any,
    ) -> None:
        options = translate_sglang_options(options)
        _check_options(options)
        self.api_key = api_key_of(options.pop("api_key", None), options.pop("api_key_file", None))
        host = options.pop("host", "127.0.0.1")
        self.port = options.pop("port", None) or free_port(host)
        self.zmq_port = options.pop("zmq_port", None) or free_port(host)
        self.address = f"tcp://{host}:{self.zmq_port}"
        self.url = f"http://{host}:{self.port}"
        self.model_path = model_path  # None: the bundled model
        if model_path is not None:
            options["model_path"] = model_path
        self.command = [
            sys.executable, "-m", "spruce.runtime", "serve",
            "--host", host, "--port", str(self.port), "--zmq-port", str(self.zmq_port),
            "--parent-pid", str(os.getpid()), *_flags(options),
        ]  # fmt: skip
        self.log_path = log_path or tempfile.mkstemp(prefix="spruce-serve-", suffix=".log")[1]
        self.endpoint: RuntimeEndpoint | None = None
        self._http: HttpEndpoint | None = None
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._child_env(),
            )
        atexit.register(self.shutdown)
        try:
            self.endpoint = self._wait_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Closes the endpoint and stops the process (SIGTERM, then SIGKILL)."""
        atexit.unregister(self.shutdown)
        if self.endpoint is not None:
            self.endpoint.close()
        if self._http is not None:
            self._http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    # -- SGLang's Runtime methods ---------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str],
        sampling_params: dict[str, Any] | None = None,
        *,
        lora_path: Any = None,
        **options: Any,
    ) -> str:
        """One /generate call; as SGLang, the JSON text of the result ({"text", "output_ids",
        "meta_info"}, or a list of them for a list of prompts). `options`: RequestOptions'
        fields but stream (return_logprob, logprob_start_len, top_logprobs_num...); None
        means the default, as in SGLang."""
        if lora_path is not None:
            raise UnsupportedFeatureError(
                "Runtime.generate(lora_path=...): Spruce serves no LoRA adapters"
            )
        given = {name: value for name, value in options.items() if value is not None}
        chosen = RequestOptions.from_keywords(given, "Runtime.generate", ("stream",))
        msg = GenerateMsg(
            rid=new_rid(), text=prompt, sampling_params=dict(sampling_params or {}),
            **chosen.to_dict(),
        )  # fmt: skip
        final = self._ready_endpoint().generate(msg)
        if final.results is not None:
            return json.dumps(final.results)
        return json.dumps(
            {"text": final.text, "output_ids": final.output_ids, "meta_info": final.meta_info}
        )

    async def async_generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None
    ) -> AsyncIterator[str]:
        """The new text of a streamed generation, chunk by chunk (SGLang's add_request)."""
        msg = GenerateMsg(rid=new_rid(), text=prompt, sampling_params=dict(sampling_params or {}))
        events = self._ready_endpoint().generate_stream(msg)
        loop = asyncio.get_running_loop()
        try:
            while True:
                event = await loop.run_in_executor(None, next, events, None)
                if event is None or isinstance(event, FinalMsg):
                    return
                if event.text:
                    yield event.text
        finally:
            with contextlib.suppress(
                ValueError
            ):  # cancelled while a thread is inside next(): GC closes it
                events.close()

    add_request = async_generate

    def get_tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (encode, decode, apply_chat_template)."""
        from spruce.runtime.models.loading.files import load_tokenizer  # reads the files only

        return load_tokenizer(self.model_path)

    def cache_prefix(self, prefix: str) -> None:
        """Puts `prefix` in the runtime's prefix cache (a zero-output request)."""
        self._ready_endpoint().commit(prefix)

    def get_server_info(self) -> dict[str, Any]:
        """The server's /server_info: model, engine configuration, options, scheduler stats."""
        if self._http is None:
            self._http = HttpEndpoint(
                self.url, api_key=self.api_key, liveness_check=self._check_alive
            )
        return self._http.get_server_info()

    def _ready_endpoint(self) -> RuntimeEndpoint:
        if self.endpoint is None:
            raise RuntimeUnavailableError(self.address, "this Runtime has been shut down")
        return self.endpoint

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - _LOG_TAIL_CHARS))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runtime({self.address!r}, pid={self.process.pid})"

    # -- internals -------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> RuntimeEndpoint:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                key = (
                    {"api_key": self.api_key} if self.api_key else {}
                )  # the server checks it on ZeroMQ too
                return RuntimeEndpoint(
                    self.address, connect_timeout=1.0, liveness_check=self._check_alive, **key
                )
            except RuntimeUnavailableError:
                if time.monotonic() > deadline:
                    raise RuntimeUnavailableError(
                        self.address,
                        f"the runtime started by `{' '.join(self.command)}` was not ready within "
                        f"{timeout:g} s; its log ({self.log_path}) ends with:\n{self.log_tail()}",
                    ) from None

    def _child_env(self) -> dict[str, str]:
        """The key goes to the server in its environment: a command line is readable by
        every local user (/proc), and this one is shown in error messages."""
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env

    def _check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise RuntimeUnavailableError(
                self.address,
                f"the runtime process exited with code {code}; its log ({self.log_path}) ends with:\n"
                f"{self.log_tail()}",
            )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_options(options: dict[str, Any]) -> None:
    known = set(known_options()) | _server_option_names()
    unknown = sorted(set(options) - known)
    if unknown:
        raise ProgramError(
            f"unknown runtime option(s) {unknown}; known: {', '.join(sorted(known))}"
        )


def _server_option_names() -> set[str]:
    return {f.name for f in fields(ServerOptions)}


def _flags(options: dict[str, Any]) -> list[str]:
    """Options -> `spruce serve` flags (model_path is --model, as in the CLI)."""
    out = []
    for key, value in options.items():
        flag = "--model" if key == "model_path" else "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out
