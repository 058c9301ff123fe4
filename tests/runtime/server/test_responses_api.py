"""POST /v1/responses driven by the openai package's own client (`client.responses`), on
the tiny model with a Qwen3-style chat template (Hermes tool calls, `<think>` blocks).
Its output is random: the tests check what holds for any output — the Responses answer
is the chat answer of the same messages (same prompt tokens, same text at temperature 0),
streamed events add up to the final body, constrained answers validate."""

from __future__ import annotations

import json
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
)
from test_chat_server import PARAMS, qwen3_style_server
from test_server import API_KEY, AUTH, stop_server

TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "Weather in Paris?"
OK_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
# the thinking block closed in the prompt (Qwen3's enable_thinking: false): the answer is
# all text, as the chat tests have it; the reasoning test opens it
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "r", "schema": OK_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def responses_server(tiny_llama_dir, tmp_path_factory):
    srv = qwen3_style_server(tiny_llama_dir, tmp_path_factory.mktemp("responses-server"))
    yield srv
    assert stop_server(srv) == 0, srv.log()


@pytest.fixture(scope="module")
def client(responses_server) -> openai.OpenAI:
    url = responses_server.url + "/v1"
    return openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


def create(client, **body) -> Response:
    body = {"model": "m", "input": QUESTION, "temperature": 0, "extra_body": NO_THINK, **body}
    return client.responses.create(**body)


def chat(client, messages, **body):
    body = {"model": "m", "messages": messages, "temperature": 0, "extra_body": NO_THINK, **body}
    return client.chat.completions.create(**body)


def test_plain_text_is_the_chat_answer(client):
    r = create(client, instructions="Be brief.", max_output_tokens=8)
    assert isinstance(r, Response) and r.object == "response" and r.id.startswith("resp_")
    [message] = r.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    same = chat(client, messages, max_tokens=8)
    assert r.output_text == same.choices[0].message.content
    usage = r.usage
    assert usage.input_tokens == same.usage.prompt_tokens
    assert usage.output_tokens == same.usage.completion_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    if same.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_settings_are_echoed_and_nothing_is_stored(client):
    r = create(client, max_output_tokens=2, store=True, metadata={"k": "v"}, top_p=0.5,
               parallel_tool_calls=False, reasoning={"effort": "low"})  # fmt: skip
    assert (r.metadata, r.top_p, r.temperature, r.max_output_tokens) == ({"k": "v"}, 0.5, 0.0, 2)
    assert r.parallel_tool_calls is False and r.reasoning.effort == "low"
    assert r.text.format.type == "text" and r.tool_choice == "auto" and r.tools == []


def test_streamed_events_add_up_to_the_answer(client):
    whole = create(client, max_output_tokens=10)
    events = list(create(client, max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]  # fmt: skip
    end = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == [*end, f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_json_schema_format_validates(client):
    r = create(client, text=JSON_FORMAT, max_output_tokens=40)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), OK_SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "r"
    with client.responses.stream(model="m", input=QUESTION, temperature=0, text=JSON_FORMAT,
                                 max_output_tokens=40, extra_body=NO_THINK) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text


def test_json_object_format(client):
    r = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=40)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_forced_call_then_its_output_then_an_answer(client):
    r = create(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=120)
    assert r.status == "completed", r
    [call] = r.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    turn = [{"role": "user", "content": QUESTION}, *r.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]  # fmt: skip
    answer = create(client, input=turn, tools=TOOLS, max_output_tokens=6)
    assert answer.output and answer.usage.output_tokens <= 6
    # the same conversation as chat messages: the same prompt
    tool_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]  # fmt: skip
    function = {"name": "get_weather", "parameters": PARAMS, "strict": True}  # strict: the default
    same = chat(client, messages, max_tokens=6, tools=[{"type": "function", "function": function}])
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    assert answer.usage.input_tokens > r.usage.input_tokens


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(client):
    plain = create(client, max_output_tokens=1)
    none = create(client, tools=TOOLS, tool_choice="none", max_output_tokens=1)
    auto = create(client, tools=TOOLS, max_output_tokens=1)
    assert none.usage.input_tokens == plain.usage.input_tokens < auto.usage.input_tokens
    assert (none.tool_choice, auto.tool_choice) == ("none", "auto")


def test_streamed_call_arguments_add_up(client):
    whole = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=120)  # fmt: skip
    events = list(create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                         max_output_tokens=120, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments
    assert json.loads(done.arguments) == json.loads(whole.output[0].arguments)
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].name == "get_weather"


def test_the_thinking_block_is_a_reasoning_item(client):
    thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    r = create(client, max_output_tokens=12, **thinking)
    first = r.output[0]
    assert isinstance(first, ResponseReasoningItem) and first.id.startswith("rs_")
    messages = [{"role": "user", "content": QUESTION}]
    same = chat(client, messages, max_tokens=12, **thinking).choices[0].message
    assert first.summary[0].text == same.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(create(client, max_output_tokens=12, stream=True, **thinking))
    pieces = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(pieces) == same.reasoning_content
    assert events[2].type == "response.output_item.added" and events[2].item.type == "reasoning"


def test_encrypted_reasoning_carries_the_thinking_into_the_next_turn(client):
    """include: ["reasoning.encrypted_content"] (Codex CLI sends it; this server is
    stateless): the item carries its reasoning, and sent back it becomes the assistant
    turn's reasoning_content again."""
    from spruce.runtime.server.openai.responses import ResponsesRequest, chat_messages

    thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    include = ["reasoning.encrypted_content"]
    r = create(client, max_output_tokens=12, include=include, **thinking)
    item = r.output[0]
    assert item.type == "reasoning" and item.encrypted_content
    streamed = list(create(client, max_output_tokens=12, include=include, stream=True, **thinking))
    assert streamed[-1].response.output[0].encrypted_content == item.encrypted_content
    plain = create(client, max_output_tokens=12, **thinking).output[0]
    assert plain.encrypted_content is None  # only when asked
    sent_back = {"type": "reasoning", "id": item.id, "summary": [],
                 "encrypted_content": item.encrypted_content}  # fmt: skip
    answer = {"type": "message", "role": "assistant", "content": "ok"}
    req = ResponsesRequest.model_validate({"model": "m", "input": [sent_back, answer]})
    assert chat_messages(req)[0]["reasoning_content"] == item.summary[0].text
    opaque = {**sent_back, "encrypted_content": "gAAAA-from-another-server"}
    req = ResponsesRequest.model_validate({"model": "m", "input": [opaque, answer]})
    assert "reasoning_content" not in chat_messages(req)[0]
    e = bad_request(client, include=["message.output_text.logprobs"])
    assert e.body["param"] == "include.0" and "not supported" in e.message


def test_an_answer_past_its_deadline_failed(client):
    """Aborted at timeout_s (Spruce's) long before 900 tokens: failed, saying why, with
    what was written so far."""
    late = {"max_output_tokens": 900, "extra_body": {**NO_THINK, "timeout_s": 0.05}}
    r = create(client, **late)
    assert r.status == "failed" and "timeout_s" in r.error.message, r
    assert r.error.code == "server_error" and all(i.status == "incomplete" for i in r.output)
    events = list(create(client, stream=True, **late))
    assert events[-1].type == "response.failed" and "timeout_s" in events[-1].response.error.message


def test_items_map_onto_chat_messages():
    """A reasoning item joins the next assistant turn; a function_call joins the assistant
    message before it; its output is a tool message."""
    from spruce.runtime.server.openai.responses import ResponsesRequest, chat_messages

    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "b", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]  # fmt: skip
    req = ResponsesRequest.model_validate({"model": "m", "input": items, "instructions": "s"})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert chat_messages(req) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "hm", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def bad_request(client, **body) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **{"max_output_tokens": 2, **body})
    return caught.value


def test_errors_name_the_field(client):
    e = bad_request(client, extra_body={"no_such_field": 1})
    assert "no_such_field" in e.message and e.body["param"] == "no_such_field"
    e = bad_request(client, previous_response_id="resp_123")
    assert "previous_response_id" in e.message and e.body["param"] == "previous_response_id"
    e = bad_request(client, tools=[{"type": "web_search"}])
    assert "web_search" in e.message and e.body["param"] == "tools.0.type"
    e = bad_request(client, input=[{"type": "item_reference", "id": "msg_1"}])
    assert "item_reference" in e.message
    e = bad_request(client, tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert "nope" in e.message and e.body["param"] == "tool_choice"
    e = bad_request(client, text={"format": {"type": "json_schema", "name": "r"}})
    assert "schema" in e.message
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    e = bad_request(client, input=[{"role": "user", "content": [image]}])
    assert "input_image" in e.message and e.body["param"] == "input.0.content.0.type"


def test_an_over_long_answer_names_max_output_tokens(client):
    e = bad_request(client, max_output_tokens=10**9)
    assert "max_output_tokens" in e.message and "max_tokens" not in e.message, e.message
    assert e.body["param"] == "max_output_tokens"


def test_the_api_key_is_checked(responses_server):
    bad = openai.OpenAI(base_url=responses_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model="m", input="hi", max_output_tokens=1)


# the SDK's event classes by their `type`
EVENT_TYPES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def sdk_errors(model: type, data: dict) -> list[dict]:
    """What the SDK's own pydantic type finds wrong with `data`, validated (the client only
    constructs); one field is left out on purpose: usage.input_tokens_details
    .cache_write_tokens (the prefix cache does not count what it stores)."""
    try:
        model.model_validate(data)
    except ValueError as e:
        return [err for err in e.errors() if err["loc"][-1] != "cache_write_tokens"]
    return []


def raw_events(text: str) -> list[dict]:
    """The SSE events of a stream; each `event:` line names its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == kind[7:]
    return events


@pytest.mark.parametrize(
    "body",
    [{"max_output_tokens": 6}, {"max_output_tokens": 12, "chat_template_kwargs": {"enable_thinking": True}},
     {"max_output_tokens": 120, "tools": TOOLS, "tool_choice": "required", **NO_THINK},
     {"max_output_tokens": 40, "text": JSON_FORMAT, **NO_THINK}],
    ids=["text", "reasoning", "calls", "json"],
)  # fmt: skip
def test_bodies_and_events_are_the_sdks_types(responses_server, body):
    body = {"model": "m", "input": QUESTION, "temperature": 0, **body}
    with httpx.Client(base_url=responses_server.url, headers=AUTH, timeout=120) as http:
        whole = http.post("/v1/responses", json=body).json()
        streamed = raw_events(http.post("/v1/responses", json={**body, "stream": True}).text)
    assert sdk_errors(Response, whole) == []
    for event in streamed:
        assert sdk_errors(EVENT_TYPES[event["type"]], event) == [], event
    assert streamed[-1]["response"]["output"] == [
        e["item"] for e in streamed if e["type"] == "response.output_item.done"
    ]
