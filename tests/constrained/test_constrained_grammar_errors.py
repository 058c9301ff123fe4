"""Grammar errors are the client's, and plain: counted repeats past llguidance's lexer are
refused at the front door; llguidance's error text becomes a sentence (never its state
dump); a grammar that matches nothing, or a token its matcher refuses past a limit, ends
that request with a ConstraintError naming the field while the engine serves the next."""

from __future__ import annotations

import re
from dataclasses import replace

import llguidance
import pytest

from spruce.constrained import ConstraintError, ConstraintSpec, GrammarCompiler, make_spec
from spruce.constrained.backends.lark_repeats import MAX_REPEAT_PRODUCT, check_repeats
from spruce.constrained.backends.llguidance_build import (
    TokenTable,
    first_mask,
    tokenizer_of,
)
from spruce.constrained.backends.llguidance_errors import plain_error
from spruce.constrained.backends.llguidance_text import lark_grammar
from spruce.runtime import ConstraintError as RuntimeConstraintError
from spruce.runtime import Engine

NO_STRING = "start: x\nx: x"  # x never ends
PAST_THE_LEXER = "start: /a{1000}{1000}/"  # a million positions in one lexeme
DUMP = re.compile(r"<state>|NoExtension|Parser: \{|compute_time_us|</grammar>")


def _bytes_tokenizer() -> llguidance.LLTokenizer:
    """One token per byte and an EOS: llguidance's messages without a model."""
    table = TokenTable(
        tuple(bytes([i]) for i in range(256)) + (b"<eos>",), (256,), (256,), None, 257
    )
    return tokenizer_of(table)


def _failure(lark: str, text: bytes = b"", **limits) -> str:
    """llguidance's raw error text for a grammar, fed `text` a byte at a time."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(
        _bytes_tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(**limits)
    )
    for byte in text:
        if matcher.is_error():
            break
        first_mask_or_none(matcher)
        if not matcher.is_error():
            matcher.consume_token(byte)
    if not matcher.is_error():
        first_mask_or_none(matcher)
    assert matcher.is_error(), lark
    return matcher.get_error()


def first_mask_or_none(matcher) -> None:
    try:
        first_mask(matcher, 9)
    except ConstraintError:
        pass


# -- the mapping of llguidance's messages ---------------------------------------------------------


@pytest.mark.parametrize(
    "lark,text,limits,expected",
    [
        (NO_STRING, b"", {}, "^the grammar matches no string"),
        ('start: "a" b\nb: b "c"', b"a", {}, "^no string the grammar matches continues"),
        (PAST_THE_LEXER, b"a", {}, "^the grammar is past llguidance's lexer limit \\(too many expressions"),
        ('start: ("a"{1000}){1000}', b"a", {}, "^the grammar is past llguidance's parser limit \\(too many items \\(limit 50000\\)\\)"),
        ("start: /[a-z]*a[a-z]{12}/", b"aaaaaaaa", {"max_lexer_states": 20}, "lexer limit \\(too many states: 20 >= 20\\)"),
        ("start: foo", b"", {}, '^line 1, column 8: unknown name: "foo"$'),
        ("start: /[/", b"", {}, '^line 1, column 8: invalid regex "\\["'),
    ],
    ids=["no-string", "no-continuation", "lexer-limit", "parser-limit", "lexer-states", "unknown-name", "bad-regex"],
)  # fmt: skip
def test_llguidance_errors_read_as_one_plain_sentence(lark, text, limits, expected):
    raw = _failure(lark, text, **limits)
    message = plain_error(raw)
    assert re.search(expected, message), (raw[:200], message)
    assert not DUMP.search(message) and "\n" not in message


def test_a_grammar_that_matches_no_string_fails_its_build_plainly(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    with pytest.raises(
        ConstraintError, match="^the grammar failed: the grammar matches no string"
    ) as info:
        compiler.compile(make_spec(lark=NO_STRING))
    assert not DUMP.search(str(info.value))
    compiler.close()


# -- counted repeats at the front door ------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,text",
    [
        ("lark", PAST_THE_LEXER),
        ("lark", 'start: B\nA: /a{1000}/\nB: A{300}'),  # through a rule it refers to
        ("lark", 'start: x{1000}\nx: "a"{1000}'),
        ("lark", 'start: "b" ~ 10..40000'),
        ("ebnf", 'root ::= x{1000}\nx ::= [a-z]{1000}'),
    ],
)  # fmt: skip
def test_counted_repeats_past_the_lexer_are_refused_at_the_front_door(kind, text):
    with pytest.raises(ConstraintError, match=f"^{kind}: rule \\w+'s counted repeats multiply to"):
        make_spec(**{kind: text})


@pytest.mark.parametrize(
    "lark",
    [
        "start: /a{100}{100}/",
        'start: "{1000}" /[{]{5}/ /x\\{9999\\}/',  # braces in literals, classes, escapes
        'start: item+\nitem: /[a-z]{1,32}/ ("," item)*',
        f"start: /a{{{MAX_REPEAT_PRODUCT}}}/",
    ],
)
def test_repeats_within_the_cap_pass(lark):
    check_repeats(lark_grammar(lark), "lark")


# -- a token the matcher refuses past its limit ---------------------------------------------------


def test_a_token_refused_past_the_lexer_limit_says_why(tiny_tokenizer):
    """Past the front door (built directly), llguidance's mask allows `a`, then its matcher
    refuses it past its lexer limit: the cursor says so in a plain sentence."""
    spec = ConstraintSpec("lark", PAST_THE_LEXER, "", backend="llguidance")
    spec = replace(spec, grammar=lark_grammar(PAST_THE_LEXER))
    compiler = GrammarCompiler(tiny_tokenizer)
    cursor = compiler.compile(spec).cursor()
    token = tiny_tokenizer.encode("a", add_special_tokens=False)[-1]
    cursor.prepare_mask()
    assert (int(cursor.row[token >> 5]) >> (token & 31)) & 1  # the mask allowed it
    assert not cursor.accept_token(token)
    assert re.match("the grammar is past llguidance's lexer limit", cursor.failure())
    compiler.close()


# -- through the engine: the client's error, and the next request served ---------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return Engine(str(tiny_llama_dir), kv_memory_gb=0.05, num_threads=1)


SAMPLED = {"temperature": 1.0, "max_new_tokens": 8, "seed": 0}


def _serves_the_next(engine) -> None:
    good = engine.generate("x", {**SAMPLED, "regex": "[ab]{3}"})
    assert re.fullmatch("[ab]{3}", good["text"])


@pytest.mark.parametrize(
    "lark,message",
    [(PAST_THE_LEXER, "^lark: rule start's counted repeats"), (NO_STRING, "^lark: .*the grammar matches no string")],
    ids=["past-the-lexer", "no-string"],
)  # fmt: skip
def test_the_engine_refuses_bad_grammars_as_the_clients_error(engine, lark, message):
    with pytest.raises(RuntimeConstraintError, match=message) as info:
        engine.generate("x", {**SAMPLED, "lark": lark})
    assert info.value.field == "lark" and not DUMP.search(str(info.value))
    _serves_the_next(engine)


def test_a_refused_token_ends_the_request_as_the_clients_error(engine, monkeypatch):
    """The counted repeats let past the front door: the scheduler samples `a` (the mask
    allowed it), the matcher refuses it past its lexer limit, and the request ends with a
    ConstraintError naming `lark` (a 400), not a fault of the server's."""
    monkeypatch.setattr("spruce.constrained.backends.lark_repeats.check_repeats", lambda *a: None)
    monkeypatch.setattr("spruce.constrained.convert._worker_request", lambda *a: None)  # here
    with pytest.raises(
        RuntimeConstraintError, match="^lark: the grammar is past llguidance's lexer"
    ) as info:
        engine.generate("x", {**SAMPLED, "lark": PAST_THE_LEXER, "max_new_tokens": 4})
    assert info.value.field == "lark"
    _serves_the_next(engine)
