"""Context-free grammars through the seam: llama.cpp's sample GBNF grammars (tests/data/gbnf/)
compile; strings sampled from each (random walks over the cursor's mask) pass an independent
check (json.loads, Python's ast, sqlite, regexes) and are accepted again token by token and
byte by byte; mutated strings that the independent check refuses are refused. Lark with
`%json`, a lazy lexeme and a special token; syntax errors with their line and column. The
slow test generates with the bundled model under json.gbnf and arithmetic.gbnf."""

from __future__ import annotations

import ast
import json
import random
import re
import sqlite3

import pytest
import torch
from support import DATA_DIR, bundled_gguf_path

from spruce.constrained import (
    ConstraintError,
    GrammarCompiler,
    allocate_bitmask,
    make_spec,
    unpack_bitmask,
)

GBNF_DIR = DATA_DIR / "gbnf"
WALKS = 6  # random walks per grammar
MUTATIONS = 12  # mutations per walk
SOFT_CAP, HARD_CAP = 30, 160  # tokens: past the soft cap a walk heads for an end


# -- independent checks (one per grammar; each says whether a text is in the language, or
# -- at least that it is not: a check may accept more than the grammar, never less) ------


def _json_of(text: str, kind: type) -> bool:
    try:
        return isinstance(json.loads(text), kind)
    except json.JSONDecodeError:
        return False


def _json_arr(text: str) -> bool:
    """json_arr.gbnf's root: "[\\n", no whitespace after the closing bracket."""
    return text.startswith("[\n") and text == text.rstrip() and _json_of(text, list)


_ARITH_ALLOWED = (ast.Expression, ast.List, ast.Compare, ast.Eq, ast.BinOp, ast.Add, ast.Sub,
                  ast.Mult, ast.Div, ast.Name, ast.Load, ast.Constant)  # fmt: skip


def _arithmetic(text: str) -> bool:
    """Each `expr = term\\n` becomes `(expr) == (term),` of a Python list parsed by ast;
    names are prefixed (so `if` is a name) and leading zeros dropped (`007`)."""
    if not re.fullmatch(r"[a-z0-9_ \t\n()=+*/-]*", text) or re.search(
        r"(?<![a-z0-9_])[0-9]+[a-z_]", text
    ):
        return False
    equations, rest = [], text
    while rest:
        lhs, equals, rest = rest.partition("=")
        term = _leading_term(rest)
        if not equals or term is None:
            return False
        tail = re.match(r"[ \t\n]*\n(?![ \t])", rest[term:])  # the term's ws, then "\n"
        if tail is None:
            return False
        equations.append(f"({_pythonic(lhs)})==({_pythonic(rest[:term])})")
        rest = rest[term + tail.end() :]
    try:
        tree = ast.parse("[" + ",".join(equations) + "]", mode="eval")
    except SyntaxError:
        return False
    return (
        bool(equations)
        and all(isinstance(node, _ARITH_ALLOWED) for node in ast.walk(tree))
        and all(node.id.startswith("v_") for node in ast.walk(tree) if isinstance(node, ast.Name))
    )


def _leading_term(text: str) -> int | None:
    """The end of the term (a name, a number or a parenthesized group) after "=" and its ws."""
    start = len(text) - len(text.lstrip(" \t\n"))
    if text[start : start + 1] != "(":
        match = re.match(r"[a-z0-9_]+", text[start:])
        return start + match.end() if match else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return None


def _pythonic(expr: str) -> str:
    expr = re.sub(r"(?<![a-z0-9_])([a-z][a-z0-9_]*)", r"v_\1", expr)
    return re.sub(r"(?<![a-z0-9_])0+(?=[0-9])", "", expr)


_MOVE = r"(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?"
_REGEXES = {
    "chess": rf"1\. {_MOVE} {_MOVE}\n(?:[1-9][0-9]?\. {_MOVE} {_MOVE}\n)+",
    "list": "(?:- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+",
    "english": r"[a-zA-Z0-9!-/:-@\[-`{-~]+(?:[ \t\n][a-zA-Z0-9!-/:-@\[-`{-~]+)*",
    "japanese": "[ぁ-ゟァ-ヿ、-〾一-鿿]+(?:[ \t\n][ぁ-ゟァ-ヿ、-〾一-鿿]+)*",
}


def _c(text: str) -> bool:
    """Necessary conditions only (no C parser here): comments closed, then C's characters,
    brackets balanced and nested, and the text empty or ending with a function's "}"."""
    code = re.sub(r"//[^\n]*\n|/\*(?:[^*]|\*[^/])*\*/", " ", text)
    if "/*" in code or "//" in code or not re.fullmatch(r"[A-Za-z0-9_ \t\n(){};,=+\-*/<>!]*", code):
        return False
    stack = []
    for char in code:
        if char in "({":
            stack.append(char)
        elif char in ")}" and (not stack or stack.pop() != "({"[")}".index(char)]):
            return False
    return not stack and (code.strip() == "" or code.rstrip().endswith("}"))


_SQL_TABLES = (
    "CREATE TABLE users(id, name, age); CREATE TABLE orders(id, user_id, total, name, age);"
)


def _sql(text: str) -> bool:
    """sqlite parses it (errors other than syntax ones, e.g. an ambiguous column, pass)."""
    if not text.endswith(";") or text.count(";") != 1:
        return False
    db = sqlite3.connect(":memory:")
    db.executescript(_SQL_TABLES)
    try:
        db.execute("EXPLAIN " + text)
    except sqlite3.OperationalError as e:
        return not re.search(r"syntax error|incomplete input|unrecognized token", str(e))
    except sqlite3.Warning:
        return False
    finally:
        db.close()
    return True


CHECKS = {
    "json": lambda text: _json_of(text, dict),
    "json_arr": _json_arr,
    "arithmetic": _arithmetic,
    "c": _c,
    "sql": _sql,
    **{
        name: (lambda text, r=regex: re.fullmatch(r, text) is not None)
        for name, regex in _REGEXES.items()
    },
}
GRAMMARS = sorted(CHECKS)
# A known difference from llama.cpp, kept visible (strict: passes once it is fixed): the GBNF
# converter makes rules of terminals only into lexemes, and llguidance's lexer is greedy. In
# arithmetic.gbnf `num ::= [0-9]+ ws` with `ws ::= [ \t\n]*` swallows the newline that
# `root ::= (expr "=" ws term "\n")+` needs, so "1+2=3\n" is refused (llama.cpp takes it).
GREEDY_LEXEMES = pytest.mark.xfail(
    strict=True, reason="greedy GBNF lexemes: arithmetic's ws eats its newline"
)
WITH_KNOWN = [
    pytest.param(name, marks=GREEDY_LEXEMES) if name == "arithmetic" else name for name in GRAMMARS
]
# These grammars' check is exact (the same language): a mutation it accepts is accepted too.
EXACT = {"list", "chess", "english", "japanese"}

# Hand-written strings per grammar: (in the language, not in it).
EXAMPLES = {
    "json": (['{"a": [1, 2.5, -0, true, null], "b": {"c": "\\u00e9\\n"}}', '{}', '{"k":"v"}\n  '],
             ['[1]', '{"a": 1,}', "{'a': 1}", '{"a": 01}', '{"a": "\x01"}', '{"a" 1}']),
    "json_arr": (['[\n{"a": 1},\n2]', '[\n]', '[\n"x",\n[true, false]]'],
                 ['[1]', '[\n1] ', '[\n1,2]', '{}']),
    "arithmetic": (["1+2=3\n", "a=b\n", "x*(y-2)=z\nfoo_1 / 4 =(5)\n", "a = ( b ) \n"],
                   ["1+2=3", "1+2==3\n", "=3\n", "a+=b\n", "A=b\n", "(a=b\n"]),
    "list": (["- one\n", "- a\n- b c\n"], ["-one\n", "- a", "- \n", "* a\n"]),
    "chess": (["1. e4 e5\n2. Nf3 Nc6\n", "1. O-O-O exd8=Q+\n12. Rxh8# a1\n"],
              ["1. e4 e5\n", "1. e9 e5\n2. a1 a2\n", "2. e4 e5\n3. a1 a2\n", "1. e4 e5\n0. a1 a2\n"]),
    "english": (["Hello, world!", "a\tb\nc"], ["", "two  spaces", "trailing ", "café"]),
    "japanese": (["こんにちは、世界。", "カタカナ ひらがな"], ["", "abc", "にほん "]),
    "c": (["int main(){return 0;}", "", "float f(int x){while(x<10){x = x+1;}// done\n}",
           "char g(){/* note */if(a==b){c = -d;}else{e (1, 2);}}"],
          ["int main(){return 0;", "int main() {}", "int 1x(){}", "double f(){}", "int f(){x=;}"]),
    "sql": (["SELECT * FROM users;", "SELECT name, COUNT(*) FROM users WHERE age >= 18 AND (name LIKE 'A%');",
             "SELECT users.id FROM users JOIN orders ON users.id = orders.user_id ORDER BY total DESC LIMIT 10;"],
            ["SELECT * FROM users", "SELECT FROM users;", "SELECT * FROM people;", "select * from users;",
             "SELECT * FROM users LIMIT 0;"]),
}  # fmt: skip


# -- compiling, walking, feeding --------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer):
    compiler = GrammarCompiler(tiny_tokenizer)
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def grammars(compiler):
    """Each sample grammar compiled once: name -> CompiledGrammar."""
    return {
        name: compiler.compile(make_spec(ebnf=(GBNF_DIR / f"{name}.gbnf").read_text()))
        for name in GRAMMARS
    }


def allowed_ids(cursor, vocab) -> list[int]:
    bitmask = allocate_bitmask(1, vocab.vocab_size)
    cursor.fill_bitmask(bitmask, 0)
    return torch.nonzero(unpack_bitmask(bitmask, vocab.vocab_size)[0]).flatten().tolist()


def random_walk(grammar, rng: random.Random) -> list[int] | None:
    """Tokens chosen at random from the cursor's mask until it may end (EOS not taken); past
    SOFT_CAP it takes a token that lets it end when one is found. None past HARD_CAP."""
    vocab, cursor, ids = grammar.vocab, grammar.cursor(), []
    while len(ids) < HARD_CAP:
        choices = [t for t in allowed_ids(cursor, vocab) if t not in vocab.eos_token_ids]
        if cursor.can_end() and (not choices or rng.random() < 0.15):
            return ids
        token = _ending_token(cursor, choices, rng) if len(ids) >= SOFT_CAP else None
        if token is None:  # single-byte punctuation half the time: structure, not just text
            short = [
                t
                for t in choices
                if len(vocab.token_bytes[t]) == 1 and not vocab.token_bytes[t].isalnum()
            ]
            token = rng.choice(short if short and rng.random() < 0.5 else choices)
        assert cursor.accept_token(token), "a token of the mask was refused"
        ids.append(token)
    return None


def _ending_token(cursor, choices: list[int], rng: random.Random) -> int | None:
    for token in rng.sample(choices, min(48, len(choices))):
        probe = cursor.copy()
        if probe.accept_token(token) and probe.can_end():
            return token
    return None


def walk_texts(grammar, seed: int, count: int) -> list[bytes]:
    rng, texts = random.Random(seed), []
    for _ in range(count * 4):
        ids = random_walk(grammar, rng)
        if ids is not None:
            texts.append(b"".join(grammar.vocab.token_bytes[t] for t in ids))
        if len(texts) == count:
            break
    assert len(texts) == count, "the random walks did not end within the cap"
    return texts


def byte_token_ids(vocab) -> dict[int, int]:
    """byte -> the id of the single-byte token (the tiny tokenizer has all 256)."""
    ids = {data[0]: i for i, data in enumerate(vocab.token_bytes) if len(data) == 1}
    assert len(ids) == 256
    return ids


def accepts(grammar, token_ids: list[int]) -> bool:
    """The whole sequence is accepted token by token and the cursor may end there."""
    cursor = grammar.cursor()
    return all(cursor.accept_token(t) for t in token_ids) and cursor.can_end()


def accepts_bytes(grammar, data: bytes) -> bool:
    byte_ids = byte_token_ids(grammar.vocab)
    return accepts(grammar, [byte_ids[b] for b in data])


def is_valid(name: str, data: bytes) -> bool:
    try:
        return CHECKS[name](data.decode("utf-8"))
    except UnicodeDecodeError:
        return False


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A byte inserted, deleted or replaced at a random place."""
    at = rng.randrange(len(data) + 1)
    byte = bytes(
        [rng.choice(b"{}[]()\",:;=+-*/\\ \n\t0a_.#'") if rng.random() < 0.7 else rng.randrange(256)]
    )
    operation = rng.choice(("insert", "delete", "replace") if data else ("insert",))
    if operation == "insert":
        return data[:at] + byte + data[at:]
    at = min(at, len(data) - 1)
    return data[:at] + (byte if operation == "replace" else b"") + data[at + 1 :]


# -- the sample grammars ----------------------------------------------------------------------


def test_every_sample_grammar_compiles_and_has_a_check():
    files = {path.stem for path in GBNF_DIR.glob("*.gbnf")}
    assert files == set(GRAMMARS)
    for name in GRAMMARS:
        spec = make_spec(ebnf=(GBNF_DIR / f"{name}.gbnf").read_text())
        assert spec.kind == "ebnf" and spec.backend == "llguidance" and spec.grammar


@pytest.mark.parametrize("name", WITH_KNOWN)
def test_hand_written_strings(grammars, tiny_tokenizer, name):
    positives, negatives = EXAMPLES[name]
    for text in positives:
        assert is_valid(name, text.encode()), f"the check refuses a positive example {text!r}"
        assert accepts(grammars[name], tiny_tokenizer.encode(text, add_special_tokens=False)), text
        assert accepts_bytes(grammars[name], text.encode()), text
    for text in negatives:  # (a check that accepts more than its grammar may accept some)
        assert not accepts_bytes(grammars[name], text.encode()), text


@pytest.mark.parametrize("name", WITH_KNOWN)
def test_sampled_strings_are_valid_and_accepted_in_any_tokenization(grammars, tiny_tokenizer, name):
    for data in walk_texts(grammars[name], seed=GRAMMARS.index(name), count=WALKS):
        assert is_valid(name, data), f"{name} walked to a text its check refuses: {data!r}"
        text = data.decode()
        assert accepts(grammars[name], tiny_tokenizer.encode(text, add_special_tokens=False)), text
        assert accepts_bytes(grammars[name], data), text


@pytest.mark.parametrize("name", WITH_KNOWN)
def test_mutated_strings_are_refused_unless_still_valid(grammars, name):
    rng = random.Random(100 + GRAMMARS.index(name))
    refused = 0
    for data in walk_texts(grammars[name], seed=GRAMMARS.index(name), count=WALKS):
        for _ in range(MUTATIONS):
            mutant = mutate(data, rng)
            accepted, valid = accepts_bytes(grammars[name], mutant), is_valid(name, mutant)
            assert valid or not accepted, f"{name} accepts the invalid mutant {mutant!r}"
            if name in EXACT:
                assert accepted == valid, f"{name}: grammar {accepted}, check {valid} on {mutant!r}"
            refused += not accepted
    assert (
        refused >= WALKS * MUTATIONS // 8
    )  # the mutations do break texts (english takes most bytes)


# -- Lark: %json, lazy lexemes, special tokens ------------------------------------------------


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_lark_with_an_embedded_json_schema(compiler, tiny_tokenizer):
    lark = 'start: "point=" point "\\n"\npoint: %json {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": false}'
    grammar = compiler.compile(make_spec(lark=lark))
    assert accepts(grammar, _ids(tiny_tokenizer, 'point={"x": 3}\n'))
    for text in (
        'point={"x": "3"}\n',
        'point={"y": 3}\n',
        'point={"x": 3, "y": 1}\n',
        "point={}\n",
    ):
        assert not accepts(grammar, _ids(tiny_tokenizer, text)), text


def test_a_lazy_lexeme_ends_at_its_first_possible_end(compiler, tiny_tokenizer):
    lazy = compiler.compile(make_spec(lark='start: think "!"\nthink[lazy]: /(.|\\n)*/ "</think>"'))
    assert accepts(lazy, _ids(tiny_tokenizer, "a plan\n</think>!"))
    assert not accepts(
        lazy, _ids(tiny_tokenizer, "a</think>b</think>!")
    )  # the lexeme ended at the first
    cursor = lazy.cursor()
    assert all(cursor.accept_token(t) for t in _ids(tiny_tokenizer, "a</think>"))
    assert allowed_ids(cursor, lazy.vocab) == _ids(tiny_tokenizer, "!")


def test_a_special_token_in_a_grammar_is_that_token_not_its_text(compiler, tiny_tokenizer):
    """`<|im_start|>` (a special token of the chatml vocabularies, the bundled one's too) in a
    Lark rule: the token id is allowed there, the same characters as plain text are not."""
    special = tiny_tokenizer.backend.token_to_id("<|im_start|>")
    assert special in tiny_tokenizer.special_token_ids
    grammar = compiler.compile(make_spec(lark='start: "x" <|im_start|> "y"'))
    cursor = grammar.cursor()
    assert cursor.accept_token(_ids(tiny_tokenizer, "x")[0])
    assert allowed_ids(cursor, grammar.vocab) == [special]
    assert accepts(grammar, [*_ids(tiny_tokenizer, "x"), special, *_ids(tiny_tokenizer, "y")])
    assert not accepts_bytes(grammar, b"x<|im_start|>y")
    free = compiler.compile(make_spec(lark="start: /[a-z<|>_]*/"))
    assert special not in allowed_ids(free.cursor(), free.vocab)  # never as text


def test_a_quoted_special_token_text_is_that_token(compiler, tiny_tokenizer):
    """`"<|im_start|>"` quoted, as users write it: llguidance's mask offers the token there,
    and the cursor takes it (the literal becomes a token reference); an EOS token the
    grammar names ends the grammar as that token."""
    special = tiny_tokenizer.backend.token_to_id("<|im_start|>")
    grammar = compiler.compile(make_spec(lark='start: "x" "<|im_start|>" "y"'))
    cursor = grammar.cursor()
    assert cursor.accept_token(_ids(tiny_tokenizer, "x")[0])
    assert allowed_ids(cursor, grammar.vocab) == [special]
    assert accepts(grammar, [*_ids(tiny_tokenizer, "x"), special, *_ids(tiny_tokenizer, "y")])
    (eos,) = grammar.vocab.eos_token_ids
    eos_text = tiny_tokenizer.decode([eos], skip_special_tokens=False)
    ending = compiler.compile(make_spec(lark=f'start: "x" "{eos_text}"'))
    cursor = ending.cursor()
    assert cursor.accept_token(_ids(tiny_tokenizer, "x")[0]) and not cursor.can_end()
    assert allowed_ids(cursor, ending.vocab) == [eos]
    assert cursor.accept_token(eos) and cursor.can_end() and cursor.is_terminated()


def test_only_whole_quoted_literals_become_token_references():
    from spruce.constrained.backends.llguidance_text import special_literals_as_tokens

    specials = {"<|im_end|>": 2, "<|im_start|>": 1}
    lark = "\n".join([
        'start: "a" "<|im_end|>" x y z w v',
        'x: "<|im_start|>"i | "<|im_end|> " | "\\"<|im_end|>"',  # flagged, longer, escaped
        'y: /"<|im_end|>"/  // "<|im_end|>" in a comment',
        'z: %json {"const": "<|im_end|>", "x": "}"}',
        'w: "\\u003c|im_start|>"',  # the same text, escaped
        'v: "<|im_end|>" "b"',
    ])  # fmt: skip
    out = special_literals_as_tokens(lark, specials).splitlines()
    assert out[0] == 'start: "a" <[2]> x y z w v'
    assert out[1:4] == lark.splitlines()[1:4]
    assert out[4:] == ["w: <[1]>", 'v: <[2]> "b"']
    assert special_literals_as_tokens("start: /[<|]/", specials) == "start: /[<|]/"


# -- syntax errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, text, position",
    [
        ("ebnf", 'root ::= "a" item\nitem ::= [a-z', "line 2, column"),
        ("ebnf", 'root ::= "a"\n\nitem ::= ("b" | "c"', "line 3, column"),
        ("ebnf", 'root ::= "a" |\nfoo ::= [', "line 2, column 5"),
        ("lark", 'start: "a" item\nitem: ("b" | "c"', "line 2, column"),
        ("lark", 'start: "a" foo\nfoo: /[a-/', "line 2, column 6"),
        ("lark", 'start: "a" FOO\nFOO: /x{3,1}/', "line 2, column 6"),
    ],
)
def test_syntax_errors_carry_line_and_column(kind, text, position):
    with pytest.raises(ConstraintError, match=re.escape(position)) as error:
        make_spec(**{kind: text})
    assert str(error.value).startswith(f"{kind}: ")


@pytest.mark.parametrize(
    "text, named", [('root ::= "a" missing', "missing"), ('start ::= "a"', "root")]
)
def test_an_undefined_rule_is_named(text, named):
    with pytest.raises(ConstraintError, match=named):
        make_spec(ebnf=text)


# -- the bundled model ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_bundled_model_writes_parseable_json_and_arithmetic():
    from spruce.runtime import Engine

    if bundled_gguf_path() is None:
        pytest.skip("the bundled model is not installed")
    engine = Engine(num_threads=2, kv_memory_gb=0.5)
    asks = {
        "json": "Describe a cat as a JSON object with its name and age.",
        "arithmetic": "Write two equations, one per line, like 1+2=3.",
    }
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks.values()
    ]
    params = [
        {"ebnf": (GBNF_DIR / f"{name}.gbnf").read_text(), "temperature": 0, "max_new_tokens": 96}
        for name in asks
    ]
    json_out, arithmetic_out = engine.generate(prompts, params)
    # json.gbnf's strings are unbounded: greedy text that differs by CPU could run to the
    # limit; a finished output must parse, a cut one is an object's prefix
    if json_out["meta_info"]["finish_reason"]["type"] == "stop":
        assert isinstance(json.loads(json_out["text"]), dict), json_out["text"]
    else:
        assert json_out["text"].startswith("{"), json_out["text"]
    # arithmetic.gbnf cannot end under llguidance (GREEDY_LEXEMES above: the model writes
    # "1+2=3\n", then only whitespace is allowed until the token limit); until that is fixed
    # the first equation, parsed by ast, is what is checked.
    text = arithmetic_out["text"]
    if arithmetic_out["meta_info"]["finish_reason"]["type"] == "stop":
        assert _arithmetic(text), text
    else:
        assert "\n" in text and _arithmetic(text[: text.index("\n") + 1]), text


def test_every_cursor_starts_from_the_first_mask_made_once(compiler):
    """The first position's mask is computed at build time and copied by every cursor (and
    again after a rollback to the start): it equals the mask the matcher computes there."""
    grammar = compiler.compile(make_spec(lark='start: "yes" | "no" | "maybe"'))
    kept = grammar.initial_row
    assert kept is not None
    grammar.initial_row = None  # a cursor that computes its first mask itself
    try:
        fresh = grammar.cursor()
        fresh.prepare_mask()
        expected = fresh.row.copy()
    finally:
        grammar.initial_row = kept
    cursor = grammar.cursor()
    cursor.prepare_mask()
    assert (cursor.row == expected).all() and expected.any()
    token = allowed_ids(cursor, grammar.vocab)[0]
    assert cursor.accept_token(token)
    cursor.prepare_mask()
    assert not (cursor.row == expected).all()
    cursor.rollback(1)
    cursor.prepare_mask()
    assert (cursor.row == expected).all()
