"""Size before work (issue 51): a prompt text that cannot fit the context, or is past
--max-prompt-bytes, and a tool list past --max-tools / --max-tools-bytes, are refused with
a 400 naming the field before anything is tokenized or rendered, on every route that takes
them (the app in-process, with a tokenizer that counts its calls); the tokenizer's bound on
a text's tokens holds on real text; the GIL-free encode gives the ids of the library's own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import tokenizers

from spruce.runtime.config import ServerOptions
from spruce.runtime.core.validation import Draft, ModelLimits, check_prompt_size
from spruce.runtime.core.values import TokenBound, utf8_length
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.limits import RequestLimits
from spruce.runtime.server.native import NATIVE_NAMES, ModelContext
from spruce.runtime.server.request_manager import Refused
from spruce.runtime.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[3]
CONTEXT = 1024
BIG = "word " * 2_400_000  # the 12 MB prompt
MODEL = "m"


class CountingTokenizer:
    """The tiny tokenizer, counting what the routes ask of it."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls = {"encode": 0, "apply_chat_template": 0}

    def encode(self, text, add_special_tokens=True):
        self.calls["encode"] += 1
        return self.inner.encode(text, add_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        self.calls["apply_chat_template"] += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RefusingManager:
    """Stands in for the scheduler: a request that passed every check is answered 503."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, items, *args, **kwargs):
        self.submitted += 1
        raise Refused(503, "no scheduler in this test")


def app_with(tokenizer: Tokenizer, limits: RequestLimits):
    from spruce.runtime.protocol.ipc import Ready
    from spruce.runtime.server.app import build_app
    from spruce.runtime.server.metrics import Metrics

    counting = CountingTokenizer(tokenizer)
    model_limits = ModelLimits(tokenizer.vocab_size, CONTEXT, limits, hidden_size=64,
                               token_bound=tokenizer.token_bound)  # fmt: skip
    model = ModelContext(counting, MODEL, "/m", model_limits)
    launcher = SimpleNamespace(options=ServerOptions(), manager=RefusingManager(), draining=False)
    ready = Ready(MODEL, "/m", CONTEXT, tokenizer.vocab_size, 1024, {})
    return build_app(launcher, model, Metrics(), ready), counting, launcher.manager


def post_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return [await c.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def message_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def param_of(response: httpx.Response) -> str | None:
    return response.json()["error"].get("param")  # Anthropic's error object has none


def prompt_requests(text: str) -> list[tuple[str, dict, str]]:
    """(route, body, the field its 400 names) of `text` as the prompt of every route."""
    user = [{"role": "user", "content": text}]
    return [
        ("/generate", {"text": text, "sampling_params": {"max_new_tokens": 4}}, "text"),
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": user, "max_tokens": 4}, "messages"),
        ("/v1/messages", {"model": MODEL, "messages": user, "max_tokens": 4}, "messages"),
        ("/v1/responses", {"model": MODEL, "input": text, "max_output_tokens": 4}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": text}, "input"),
        ("/encode", {"text": text}, "text"),
    ]


# -- prompts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limits,reason,renders",
    [(RequestLimits(), "--max-prompt-bytes", 0),
     (RequestLimits(max_prompt_bytes=10**9), "context", 3)],
    ids=["byte-cap", "token-bound"],
)  # fmt: skip
def test_a_12_mb_prompt_is_refused_on_every_route_before_tokenizing(
    tiny_tokenizer, limits, reason, renders
):
    """The issue's reproduction on each prompt-bearing route: a 400 naming the field, and
    the tokenizer never asked: by the byte cap (chat messages before they are rendered),
    or, with the cap raised, by the tokenizer's bound (on the rendered text: a template may
    leave some of the messages' text out, so the bound holds for what it renders)."""
    app, counting, manager = app_with(tiny_tokenizer, limits)
    cases = prompt_requests(BIG)
    responses = post_all(app, [(path, body) for path, body, _ in cases])
    for (path, _, field), r in zip(cases, responses):
        assert r.status_code == 400, (path, r.text[:300])
        message = message_of(r)
        assert message.startswith(field) and reason in message, (path, message)
        assert param_of(r) in (field, None), (path, r.json())
    assert counting.calls == {"encode": 0, "apply_chat_template": renders}
    assert manager.submitted == 0


def test_a_prompt_within_the_limits_is_tokenized_and_submitted(tiny_tokenizer):
    """The control: the same routes with a short prompt reach the tokenizer and the
    scheduler (here a stand-in that answers 503)."""
    app, counting, manager = app_with(tiny_tokenizer, RequestLimits())
    cases = prompt_requests("a short prompt")
    responses = post_all(app, [(path, body) for path, body, _ in cases])
    assert [r.status_code for r in responses] == [503] * len(cases), [r.text for r in responses]
    assert counting.calls["encode"] == len(cases) and manager.submitted == len(cases)
    assert counting.calls["apply_chat_template"] == 3  # chat, Anthropic, Responses


def test_a_long_message_history_is_refused_before_it_is_rendered(tiny_tokenizer):
    app, counting, _ = app_with(tiny_tokenizer, RequestLimits())
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 2000}
             for i in range(9)]  # fmt: skip
    [r] = post_all(app, [("/v1/chat/completions", {"model": MODEL, "messages": turns})])
    assert r.status_code == 400 and "--max-prompt-bytes" in message_of(r)
    assert param_of(r) == "messages"
    assert counting.calls == {"encode": 0, "apply_chat_template": 0}


def test_a_batch_names_the_prompt_past_the_limit(tiny_tokenizer):
    model = ModelContext(tiny_tokenizer, MODEL, "/m", ModelLimits(384, CONTEXT))
    with pytest.raises(InvalidRequestError, match=r"^text\[1\] has 40000 bytes; at most 32768"):
        model.check(Draft(["hi", "x" * 40_000], sampling={"max_new_tokens": 1}), NATIVE_NAMES)


def test_the_bound_refuses_only_what_cannot_fit(tiny_tokenizer):
    """Under the bound the text is tokenized, and a prompt longer than the context is
    refused by its real count; past the bound, before tokenizing."""
    bound = tiny_tokenizer.token_bound
    limits = ModelLimits(384, CONTEXT, RequestLimits(max_prompt_bytes=10**9), token_bound=bound)
    fits_bound = "x" * (bound.max_bytes * (CONTEXT - 1))
    with pytest.raises(InvalidRequestError, match="the prompt has .* tokens"):
        ModelContext(tiny_tokenizer, MODEL, "/m", limits).check(Draft(fits_bound), NATIVE_NAMES)
    with pytest.raises(InvalidRequestError, match=f"at least {CONTEXT} tokens"):
        check_prompt_size(fits_bound + "x" * bound.max_bytes, limits, "text")


# -- tools ---------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}}}


def tool_requests(count: int, schema: dict) -> list[tuple[str, dict]]:
    """`count` tools with `schema` through chat, Anthropic and Responses (tool_choice auto)."""
    user = [{"role": "user", "content": "hi"}]
    chat = [{"type": "function", "function": {"name": f"f{i}", "description": "looks up a city",
             "parameters": schema}} for i in range(count)]  # fmt: skip
    anthropic = [{"name": f"f{i}", "input_schema": schema} for i in range(count)]
    responses = [{"type": "function", "name": f"f{i}", "parameters": schema} for i in range(count)]
    return [
        ("/v1/chat/completions",
         {"model": MODEL, "messages": user, "tools": chat, "tool_choice": "auto"}),
        ("/v1/messages", {"model": MODEL, "messages": user, "max_tokens": 4, "tools": anthropic,
                          "tool_choice": {"type": "auto"}}),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": user, "tools": anthropic}),
        ("/v1/responses", {"model": MODEL, "input": "hi", "tools": responses,
                           "tool_choice": "auto"}),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "count,schema,reason",
    [(8000, SCHEMA, "--max-tools"),
     (40, {**SCHEMA, "description": "x" * 30_000}, "--max-tools-bytes")],
    ids=["8000-tools", "large-schemas"],
)  # fmt: skip
def test_a_tool_list_past_the_limits_is_refused_before_rendering(
    tiny_tokenizer, count, schema, reason
):
    app, counting, manager = app_with(tiny_tokenizer, RequestLimits())
    for (path, _), r in zip(
        tool_requests(count, schema), post_all(app, tool_requests(count, schema))
    ):
        assert r.status_code == 400, (path, r.text[:300])
        assert message_of(r).startswith("tools") and reason in message_of(r), (path, r.text)
        assert param_of(r) in ("tools", None), path
    assert counting.calls == {"encode": 0, "apply_chat_template": 0}
    assert manager.submitted == 0


def test_the_tool_limits_are_the_servers(tiny_tokenizer):
    app, _, manager = app_with(tiny_tokenizer, RequestLimits(max_tools=3))
    [chat4, *_] = tool_requests(4, SCHEMA)
    [chat3, *_] = tool_requests(3, SCHEMA)
    refused, taken = post_all(app, [chat4, chat3])
    assert refused.status_code == 400 and "at most 3 (--max-tools)" in message_of(refused)
    assert taken.status_code == 503 and manager.submitted == 1  # rendered and submitted


def test_legacy_functions_are_refused_before_rendering(tiny_tokenizer):
    app, counting, _ = app_with(tiny_tokenizer, RequestLimits())
    functions = [{"name": f"f{i}", "parameters": SCHEMA} for i in range(8000)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "functions": functions}  # fmt: skip
    [r] = post_all(app, [("/v1/chat/completions", body)])
    assert r.status_code == 400 and param_of(r) == "functions", r.text
    assert "send tools" in message_of(r)
    assert counting.calls == {"encode": 0, "apply_chat_template": 0}


# -- the tokenizer's bound and its encode --------------------------------------------------


def real_texts() -> list[str]:
    """Real text of several kinds: prose, Markdown tables, Python, JSON, and non-ASCII."""
    docs = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))[:6]]
    code = [(ROOT / "runtime" / "text" / "tokenizer.py").read_text()]
    other = [
        json.dumps({"ünïcödé": ["日本語のテキスト", "한국어", "emoji 🙂🚀"], "n": [1, 22, 333]}),
        "Ελληνικά και Русский текст, עברית, العربية; e\u0301 vs \u00e9; \u1100\u1161\u11a8",
        " " * 500 + "\n" * 50 + "#" * 300 + "\t" * 40 + "=" * 200,
        "control \x04\x06\x13 bytes\x1d and <|im_start|>special<|im_end|> text",
    ]
    return docs + code + other


def assert_bound_holds(tokenizer: Tokenizer) -> None:
    bound = tokenizer.token_bound
    assert bound is not None
    for text in real_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert bound.least_tokens(text) <= len(ids), text[:80]


def test_the_hf_folder_tokenizer_bound_holds_and_encode_matches(tiny_tokenizer):
    assert_bound_holds(tiny_tokenizer)
    assert tiny_tokenizer.token_bound.max_bytes < 64  # a tiny vocabulary: short tokens


@pytest.mark.slow
def test_the_bundled_tokenizer_bound_holds_and_encode_matches():
    from spruce.runtime.models.loading.files import load_tokenizer

    tokenizer = load_tokenizer()
    assert_bound_holds(tokenizer)
    bound = tokenizer.token_bound
    # SmolLM2 has no token for six ASCII control bytes (dropped), nor for two lead bytes of
    # unassigned planes: its bound covers ASCII text only
    assert bound.dropped == "\x04\x06\x13\x14\x16\x1d" and bound.ascii_only
    assert tokenizer.encode("a" + "\x04" * 1000 + "b", add_special_tokens=False) == [81, 82]
    assert bound.least_tokens("a" + "\x04" * 1000 + "b") <= 2


def _backend(normalizer=None, pre_tokenizer=None) -> tokenizers.Tokenizer:
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"ĠĠĠĠ": len(alphabet)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer or tokenizers.pre_tokenizers.ByteLevel()
    backend.decoder = tokenizers.decoders.ByteLevel()
    return backend


def test_the_bound_is_known_only_where_it_holds():
    nfc = tokenizers.normalizers.NFC()
    whitespace = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.WhitespaceSplit(), tokenizers.pre_tokenizers.ByteLevel()]
    )
    lowercase = tokenizers.normalizers.Lowercase()

    def bound(backend: tokenizers.Tokenizer) -> TokenBound | None:
        return Tokenizer(backend, bos_token_id=None, eos_token_ids=[]).token_bound

    assert bound(_backend()) == TokenBound(4)  # the longest token: four spaces
    assert bound(_backend(nfc)) == TokenBound(12)  # NFC may compose 3 bytes into 1
    assert bound(_backend(pre_tokenizer=whitespace)) is None  # whitespace is dropped
    assert bound(_backend(lowercase)) is None  # Kelvin sign (3 bytes) -> "k"
    jamo = "\u1100\u1161\u11a8" * 100  # 900 bytes; NFC: 100 syllables, 300 bytes
    nfc_tokenizer = Tokenizer(_backend(nfc), bos_token_id=None, eos_token_ids=[])
    assert nfc_tokenizer.token_bound.least_tokens(jamo) <= len(nfc_tokenizer.encode(jamo))


def test_utf8_length_counts_bytes_without_failing_on_surrogates():
    assert utf8_length("abc") == 3 and utf8_length("é日🙂") == 2 + 3 + 4
    assert utf8_length("\ud800") == 3  # a lone surrogate, as JSON may carry one


def test_the_offline_engine_refuses_by_the_bound_before_tokenizing(tiny_llama_dir):
    from spruce.runtime import Engine

    limits = {"max_prompt_bytes": 10**9}
    with Engine(str(tiny_llama_dir), num_threads=1, kv_memory_gb=0.02, request_limits=limits) as e:
        bound, context = e.core.tokenizer.token_bound, e.core.context_len
        text = "x" * (bound.max_bytes * (context + 1))
        with pytest.raises(
            InvalidRequestError, match=rf"at least \d+ tokens .* context is {context}"
        ):
            e.generate(text, {"max_new_tokens": 1})
