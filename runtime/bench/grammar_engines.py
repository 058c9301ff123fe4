"""The engines `spruce bench grammar` measures, behind one small interface.

    engine = Engine.create(tokenizer, backend)   # None when the engine is not installed
    compiled = engine.compile(kind, value)       # kind "json_schema" | "regex"; raises if refused
    cursor = compiled.cursor()
    cursor.mask(); cursor.allows(t); cursor.accept(t); cursor.can_end()

mask() is what is timed: Spruce's prepare_mask + fill_bitmask, llguidance's
unsafe_compute_mask_ptr, XGrammar's fill_next_token_bitmask, each into its own int32 row.
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata

import numpy as np
import torch

from spruce.constrained.core.bitmask import num_words

MASK_BUDGET = 10**9  # prepare_mask's new-state budget: unbounded (the whole mask is timed)
# The peers' JSON output as compact as ours: no whitespace between tokens.
LLG_OVERRIDES = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

COMPILE_TIMEOUT_S = 30  # a compile past it counts as refused (the server's grammar timeout)


SPRUCE_BACKENDS = ("spruce", "llguidance", "auto")  # the Spruce backends the bench measures


def _allows(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except OSError:
        return ""
    return f"({out.stdout.strip()})" if out.returncode == 0 else ""


# -- Spruce: make_spec + GrammarCompiler, one backend ------------------------------------------


class SpruceEngine:
    def __init__(self, tokenizer, backend: str) -> None:
        from spruce.constrained import GrammarCompiler

        self.backend = backend
        self.version = _git_head()
        # cache_size=1: every compile is cold; the walks of one constraint share its grammar
        self.compiler = GrammarCompiler(
            tokenizer, cache_size=1, timeout_s=COMPILE_TIMEOUT_S, cache_bytes=1 << 40
        )
        # workers started, vocabularies built: start-up is not a compile
        for kind, value in (("regex", "warm[0-9]"), ("json_schema", {"type": "integer"})):
            self.compile(kind, value)

    @classmethod
    def create(cls, tokenizer, backend: str) -> SpruceEngine:
        return cls(tokenizer, backend)

    def compile(self, kind: str, value) -> SpruceCompiled:
        from spruce.constrained import make_spec

        spec = make_spec(**{kind: value}, backend=self.backend)
        return SpruceCompiled(self.compiler.compile(spec), kind, value)

    def release(self) -> None:
        """Drops the last compiled grammar (done with its walks): freeing it is not the next
        constraint's compile (the peers' compiled objects go when `measure` returns)."""
        self.compiler.clear()

    def close(self) -> None:
        self.compiler.close()


class SpruceCompiled:
    def __init__(self, grammar, kind: str, value) -> None:
        self.grammar = grammar
        self.unenforced = grammar.spec.unenforced
        self.words = num_words(grammar.vocab.vocab_size)
        self._kind, self._value, self._orders = kind, value, None

    def cursor(self) -> SpruceCursor:
        return SpruceCursor(self.grammar.cursor(), self.words)

    def text(self, instance) -> str | None:
        """The instance with its keys in the order Spruce's automaton writes them (the
        converter's recorded order); None where the grammar is not Spruce's automaton."""
        if self._kind != "json_schema" or self.grammar.spec.backend != "spruce":
            return None
        from spruce.constrained.schema.json_schema import canonical_instance, convert_schema

        if self._orders is None:
            self._orders = convert_schema(self._value).orders
        return canonical_instance(instance, self._orders)


class SpruceCursor:
    def __init__(self, cursor, words: int) -> None:
        self.cursor = cursor
        self.bitmask = torch.zeros((1, words), dtype=torch.int32)
        self.row = self.bitmask[0].numpy()

    def mask(self) -> None:
        self.cursor.prepare_mask(MASK_BUDGET)
        self.cursor.fill_bitmask(self.bitmask, 0)

    def allows(self, token_id: int) -> bool:
        return _allows(self.row, token_id)

    def accept(self, token_id: int) -> bool:
        return self.cursor.accept_token(token_id)

    def can_end(self) -> bool:
        return self.cursor.can_end()


# -- llguidance, called directly ---------------------------------------------------------------


class LLGuidanceEngine:
    def __init__(self, tokenizer) -> None:
        import llguidance

        from spruce.constrained.automaton.vocab import TokenVocabulary
        from spruce.constrained.backends.llguidance import llg_tokenizer

        self.llguidance = llguidance
        self.version = _version("llguidance")
        vocab = TokenVocabulary(tokenizer)
        self.tokenizer = llg_tokenizer(vocab)
        self.words = vocab.num_words

    @classmethod
    def create(cls, tokenizer, backend=None) -> LLGuidanceEngine | None:
        try:
            return cls(tokenizer)
        except ImportError:
            return None

    def compile(self, kind: str, value) -> LLGuidanceCompiled:
        matcher_class = self.llguidance.LLMatcher
        if kind == "regex":
            grammar = matcher_class.grammar_from_regex(value)
        else:
            grammar = matcher_class.grammar_from_json_schema(value, overrides=LLG_OVERRIDES)
        matcher = matcher_class(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return LLGuidanceCompiled(matcher, self.words)

    def close(self) -> None:
        pass


class LLGuidanceCompiled:
    unenforced = ()

    def __init__(self, matcher, words: int) -> None:
        self.matcher = matcher
        self.words = words

    def cursor(self) -> LLGuidanceCursor:
        return LLGuidanceCursor(self.matcher.deep_copy(), self.words)

    def text(self, instance) -> None:
        return None  # llguidance writes definition order: one of the texts every engine gets


class LLGuidanceCursor:
    def __init__(self, matcher, words: int) -> None:
        self.matcher = matcher
        self.row = np.zeros(words, dtype=np.int32)

    def mask(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.row.ctypes.data, self.row.nbytes)

    def allows(self, token_id: int) -> bool:
        return _allows(self.row, token_id)

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(
            token_id
        )  # a refused token leaves it in error: cursor done

    def can_end(self) -> bool:
        return self.matcher.is_accepting()


# -- XGrammar, called directly -----------------------------------------------------------------


class XGrammarEngine:
    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgrammar = xgrammar
        self.version = _version("xgrammar")
        self.vocab_size = tokenizer.vocab_size
        info = xgrammar.TokenizerInfo(
            tokenizer.token_bytes(), xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids),
        )  # fmt: skip
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def create(cls, tokenizer, backend=None) -> XGrammarEngine | None:
        try:
            return cls(tokenizer)
        except ImportError:
            return None

    def compile(self, kind: str, value) -> XGrammarCompiled:
        if kind == "regex":
            return XGrammarCompiled(self, self.compiler.compile_regex(value))
        compiled = self.compiler.compile_json_schema(
            json.dumps(value), any_whitespace=False, separators=(",", ":")
        )
        return XGrammarCompiled(self, compiled)

    def close(self) -> None:
        pass


class XGrammarCompiled:
    unenforced = ()

    def __init__(self, engine: XGrammarEngine, compiled) -> None:
        self.engine = engine
        self.compiled = compiled

    def cursor(self) -> XGrammarCursor:
        xgrammar = self.engine.xgrammar
        return XGrammarCursor(
            xgrammar.GrammarMatcher(self.compiled),
            xgrammar.allocate_token_bitmask(1, self.engine.vocab_size),
        )

    def text(self, instance) -> None:
        return None  # XGrammar writes definition order: one of the texts every engine gets


class XGrammarCursor:
    def __init__(self, matcher, bitmask: torch.Tensor) -> None:
        self.matcher = matcher
        self.bitmask = bitmask
        self.row = bitmask[0].numpy()

    def mask(self) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)

    def allows(self, token_id: int) -> bool:
        return _allows(self.row, token_id)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def can_end(self) -> bool:
        return self.matcher.is_completed()
