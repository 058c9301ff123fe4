"""The limits that keep one client from hurting the others, with their defaults, in one place.

`RequestLimits`: what one request (one API call) may ask for. Checked at the validation
boundary (`core.validation`) by every front end: the offline Engine (with these defaults),
HTTP and ZeroMQ (from the server's flags).

`ServingLimits`: queues and fairness in the server's front end (`server.request_manager`):
how many requests may wait, how many one client may have in flight, how far a streaming
reader may fall behind, and the default request deadline; and its doors: open HTTP
connections, the time to send a request's headers, ZeroMQ bytes in flight per client.

Each field is a `spruce serve` flag of the same name (`--max-stop-strings 8`).
"""

from __future__ import annotations

from dataclasses import dataclass

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    max_new_tokens_limit: int | None = None  # cap on max_new_tokens; None: the context length
    max_n: int = 128  # choices per prompt (OpenAI's n)
    max_batch_size: int = 256  # requests in one call: prompts x n
    max_top_logprobs: int = 20  # top_logprobs_num / top_logprobs / logprobs
    max_stop_strings: int = 32  # entries of stop
    max_stop_string_chars: int = 512  # characters of one stop string
    max_stop_token_ids: int = 256  # entries of stop_token_ids
    max_logit_bias: int = 1024  # entries of logit_bias
    max_constraint_chars: int = 200_000  # characters of a regex, a JSON schema or all choices
    max_choices: int = 4096  # entries of choices
    max_tokenize_chars: int = 1_000_000  # characters of all prompts of one /tokenize call
    max_detokenize_ids: int = 1_000_000  # token ids of one /detokenize call
    max_logprob_entries: int = 2_000_000  # logprobs a call returns: positions x (1 + top), summed
    max_prompt_bytes: int | None = None  # bytes of one prompt's text; None: 32 per context token
    max_tools: int = 512  # entries of tools (chat, Anthropic, Responses)
    max_tools_bytes: int = 2**20  # bytes of the tools with their schemas, as JSON


@dataclass(frozen=True)
class ServingLimits:
    max_waiting_requests: int = 1024  # beyond --max-running-requests; then 503 + Retry-After
    max_requests_per_client: int = 512  # in flight per HTTP address / ZeroMQ identity; then 429
    # prompt tokens in flight per client; then 429 (a client with nothing in flight may exceed it)
    max_tokens_per_client: int = 262_144
    max_stream_backlog: int = 2048  # unread events per streamed request; beyond: aborted
    request_timeout_s: float | None = None  # a request's default timeout_s; None: no deadline
    scheduler_timeout_s: float = (
        120.0  # a scheduler silent this long (a step stuck) is stalled: its requests fail, 503
    )
    retry_after_s: int = 1  # the Retry-After header of a 503 / 429
    max_connections: int = 1024  # open HTTP connections; past it requests get 503
    header_timeout_s: float = (
        10.0  # an HTTP connection that has not sent a request's headers in this time is closed
    )
    max_zmq_bytes_per_client: int = (
        64 * 2**20
    )  # bytes of ZeroMQ messages one identity has in flight; then 429
