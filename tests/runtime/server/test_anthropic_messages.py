"""POST /v1/messages and /v1/messages/count_tokens with the real `anthropic` client, on a
server with the Qwen3-style template of test_chat_server (its `<think>` blocks and the
Hermes tool-call format). The tiny model's output is random: the tests check what holds
for any output, and that each answer is the chat path's (the same prompt, the same
greedy text, streamed or not)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest
from test_chat_server import PARAMS, qwen3_style_server
from test_server import API_KEY, AUTH, stop_server

from spruce.runtime.server.anthropic.mapping import chat_request
from spruce.runtime.server.anthropic.routes import answered
from spruce.runtime.server.anthropic.schemas import MessagesRequest
from spruce.runtime.server.anthropic.views import MessageView
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
from spruce.runtime.server.openai.tool_parsers import TOOL_CALL_FORMATS
from spruce.runtime.server.request_manager import Refused
from spruce.runtime.server.request_state import Event
from spruce.runtime.text.reasoning import REASONING_FORMATS

USER = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"type": "disabled"}
EVENT_TYPES = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop"}  # fmt: skip
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": PARAMS}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = qwen3_style_server(tiny_llama_dir, tmp_path_factory.mktemp("anthropic-server"))
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


# in extra_body: the newest clients dropped the sampling arguments, older ones lack output_config
GREEDY = {"temperature": 0}


def create(client, extra_body=None, **body):
    body = {"model": "m", "max_tokens": 8, "messages": USER, **body}
    return client.messages.create(**body, extra_body={**GREEDY, **(extra_body or {})})


def streamed(client, extra_body=None, **body):
    """(the event types in order, deltas of a block as one, the final message) of a stream."""
    body = {"model": "m", "max_tokens": 8, "messages": USER, **body}
    with client.messages.stream(**body, extra_body={**GREEDY, **(extra_body or {})}) as stream:
        types = [e.type for e in stream if e.type in EVENT_TYPES]
        message = stream.get_final_message()
    return [
        t for i, t in enumerate(types) if t != "content_block_delta" or types[i - 1] != t
    ], message


def chat(http, **body) -> dict:
    body = {"model": "m", "messages": USER, "temperature": 0, **body}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def texts(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_is_the_chat_paths_answer_with_its_usage(client, http):
    message = create(client, thinking=NO_THINKING)
    assert (message.type, message.role, message.model) == ("message", "assistant", "m")
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    same = chat(http, max_tokens=8, chat_template_kwargs={"enable_thinking": False})
    assert texts(message) == same["choices"][0]["message"]["content"]
    usage = message.usage
    assert 0 < usage.output_tokens <= 8
    assert usage.output_tokens == same["usage"]["completion_tokens"]
    assert usage.input_tokens + usage.cache_read_input_tokens == same["usage"]["prompt_tokens"]
    count = client.messages.count_tokens(model="m", messages=USER, thinking=NO_THINKING)
    assert count.input_tokens == same["usage"]["prompt_tokens"]


def test_streamed_text_in_anthropics_event_sequence(client):
    types, message = streamed(client, thinking=NO_THINKING)
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1:-2] == ["content_block_start", "content_block_delta", "content_block_stop"]
    whole = create(client, thinking=NO_THINKING)
    assert texts(message) == texts(whole) and message.stop_reason == whole.stop_reason
    assert message.usage.output_tokens == whole.usage.output_tokens


def test_events_are_named_as_anthropic_sends_them(http):
    body = {"model": "m", "max_tokens": 4, "messages": USER, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] == "message_stop"
    assert data[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_thinking_blocks_are_the_reasoning_parsers_split(client, http):
    """The prompt ends in an open `<think>`: the output is thinking until `</think>`."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    raw = chat(
        http,
        max_tokens=12,
        separate_reasoning=False,
        chat_template_kwargs={"enable_thinking": True},
    )
    reasoning, answer = REASONING_FORMATS["qwen3"].split(
        raw["choices"][0]["message"]["content"], inside=True
    )
    for message in (
        create(client, max_tokens=12, thinking=thinking),
        streamed(client, max_tokens=12, thinking=thinking)[1],
    ):
        blocks = [b for b in message.content if b.type == "thinking"]
        assert [b.thinking for b in blocks] == ([reasoning] if reasoning else [])
        assert texts(message) == answer


def test_a_json_schema_answer_validates(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    output = {"format": {"type": "json_schema", "schema": schema}}
    for message in (
        create(client, max_tokens=60, thinking=NO_THINKING, extra_body={"output_config": output}),
        streamed(client, max_tokens=60, thinking=NO_THINKING, extra_body={"output_config": output})[
            1
        ],
    ):
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(texts(message)), schema)


def test_stop_sequences_are_named(client):
    text = texts(create(client, max_tokens=12, thinking=NO_THINKING))
    stop = text.strip()[1:3]
    assert len(stop) == 2, text
    message = create(client, max_tokens=12, thinking=NO_THINKING, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert texts(message) == text[: text.find(stop)]


def test_a_tool_call_round_trip(client, http):
    forced = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"},
              "thinking": NO_THINKING, "max_tokens": 120}  # fmt: skip
    message = create(client, **forced)
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, PARAMS)
    types, again = streamed(client, **forced)
    assert again.stop_reason == "tool_use" and again.content[0].input == call.input
    assert types[1:-2] == ["content_block_start", "content_block_delta", "content_block_stop"]
    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "18 C"}],
    }
    conversation = [*USER, {"role": "assistant", "content": message.content},
                    {"role": "user", "content": [result]}]  # fmt: skip
    final = create(client, messages=conversation, tools=TOOLS, thinking=NO_THINKING)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in final.content)
    # the conversation is the chat path's: an assistant call, then a tool message
    openai_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(call.input)},
    }
    same = [*USER, {"role": "assistant", "content": None, "tool_calls": [openai_call]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]  # fmt: skip
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS},
        }
    ]
    openai = chat(
        http,
        messages=same,
        tools=tools,
        max_tokens=8,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert texts(final) == (openai["choices"][0]["message"]["content"] or "")
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == openai["usage"]["prompt_tokens"]
    )


def test_count_tokens_counts_the_tools_the_template_shows(client):
    plain = client.messages.count_tokens(model="m", messages=USER).input_tokens
    with_tools = client.messages.count_tokens(model="m", messages=USER, tools=TOOLS).input_tokens
    hidden = client.messages.count_tokens(
        model="m", messages=USER, tools=TOOLS, tool_choice={"type": "none"}
    ).input_tokens
    assert with_tools > plain == hidden


def test_errors_are_anthropics_shapes_the_client_raises(client, server):
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [image]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["type"] == "error"
    assert "messages.0.content.0: image blocks are not supported" in info.value.message
    with pytest.raises(anthropic.BadRequestError, match="temperature"):  # the validator's 400
        create(client, extra_body={"temperature": -1.0})
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        create(client, stop_sequences=["x"] * 1000)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # past the context
        create(client, max_tokens=10**6)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # before any token streams
        streamed(client, max_tokens=10**6)
    with pytest.raises(anthropic.BadRequestError, match="top_k must be"):
        create(client, extra_body={"top_k": 0})
    bad_schema = {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}
    with pytest.raises(anthropic.BadRequestError, match="output_config.format: unknown type"):
        create(client, extra_body={"output_config": bad_schema})
    with pytest.raises(anthropic.NotFoundError, match="does not exist") as info:
        create(client, model="other")
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="unknown_field"):
        create(client, extra_body={"unknown_field": 1})
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError, match="wrong API key") as info:
        create(wrong)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_max_tokens_is_required(http):
    r = http.post("/v1/messages", json={"model": "m", "messages": USER})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]


def test_x_api_key_is_the_api_key(server):
    """Anthropic's clients send the key as `x-api-key` (the newest send a Bearer token
    unless told otherwise)."""
    for key, status in ((API_KEY, 200), ("wrong", 401)):
        headers = {"x-api-key": key}
        body = {"model": "m", "max_tokens": 1, "messages": USER}
        assert (
            httpx.post(server.url + "/v1/messages", json=body, headers=headers).status_code
            == status
        )
    only_x_api_key = {"X-Api-Key": API_KEY, "Authorization": anthropic.Omit()}
    client = anthropic.Anthropic(
        base_url=server.url, api_key=API_KEY, default_headers=only_x_api_key
    )
    assert create(client, max_tokens=1).type == "message"


def test_blocks_map_onto_the_chat_messages():
    """Thinking passed back is the assistant's reasoning_content; a failed tool's result
    says so; system blocks join; disable_parallel_tool_use is parallel_tool_calls false."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": "no such city",
        "is_error": True,
    }
    body = {
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "messages": [*USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""}, call]},
                     {"role": "user", "content": [result, {"type": "text", "text": "and?"}]}],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    req = chat_request(MessagesRequest.model_validate(body))
    system, _, assistant, tool, user = req.messages
    assert system.content == "a\nb" and assistant.reasoning_content == "hm"
    assert assistant.tool_calls[0].function.arguments == {"city": "Oslo"}
    assert (tool.role, tool.tool_call_id, tool.content) == (
        "tool",
        "toolu_1",
        "Error: no such city",
    )
    assert (user.role, user.content) == ("user", "and?")
    assert (req.tool_choice, req.parallel_tool_calls, req.max_tokens) == ("required", False, 5)


# -- the view and the error wrapper, without a model ------------------------------------------


def test_a_stream_opens_a_block_per_kind_and_ends_in_an_error_event_once_started():
    """Thinking, then text, then a call: three blocks, each opened and closed in order; the
    input_json_delta pieces add up to the call's input. A later failure is an error event."""
    prompt = ChatPrompt("", [1, 2, 3], REASONING_FORMATS["qwen3"], thinking=True)
    tools = ToolPlan(
        [{"type": "function", "function": {"name": "f"}}], "auto", TOOL_CALL_FORMATS["hermes"], None
    )
    view = MessageView(MessagesRequest.model_validate({"model": "m", "max_tokens": 9, "messages": USER}),
                       SimpleNamespace(prompt=prompt, tools=tools))  # fmt: skip
    text = 'hm</think>Hi<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    meta = {
        "cached_tokens": 1,
        "completion_tokens": 7,
        "finish_reason": {"type": "stop", "matched": 0},
    }
    events = [Event(0, text[i : i + 4], meta_info=meta) for i in range(0, len(text), 4)]
    events[-1].finished = True
    events.append(Event(0, error="gone", status=500))
    data = asyncio.run(_events(view.stream(_Call(events))))
    kinds = [d["type"] for d in data]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3 and kinds[-3:] == [
        "message_delta",
        "message_stop",
        "error",
    ]
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "hm"
    assert "".join(d.get("text", "") for d in deltas) == "Hi"
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"a": 1}
    assert data[-3]["delta"]["stop_reason"] == "tool_use"
    assert data[-3]["usage"] == {"input_tokens": 2, "output_tokens": 7, "cache_read_input_tokens": 1,
                                 "cache_creation_input_tokens": 0}  # fmt: skip
    assert data[-1]["error"] == {"type": "api_error", "message": "gone"}


def test_refusals_for_load_are_overloaded_or_rate_limit_errors():
    metrics = Metrics()
    request = SimpleNamespace(
        app=SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(metrics=metrics)))
    )
    for status, kind in ((503, "overloaded_error"), (429, "rate_limit_error")):

        async def refused(_request, status=status):
            raise Refused(status, "busy", retry_after_s=2)

        response = asyncio.run(answered(request, refused))
        assert response.status_code == status and response.headers["Retry-After"] == "2"
        assert json.loads(response.body) == {
            "type": "error",
            "error": {"type": kind, "message": "busy"},
        }


class _Call:
    def __init__(self, events):
        self.events = events

    async def __aiter__(self):
        for e in self.events:
            yield e


async def _events(chunks) -> list[dict]:
    out = []
    async for chunk in chunks:
        name, data = chunk.decode().split("\n")[:2]
        assert name == "event: " + json.loads(data[6:])["type"]
        out.append(json.loads(data[6:]))
    return out
