"""Tokenizer: encode / decode on the `tokenizers` library, raw token bytes for the
constrained decoder, incremental UTF-8-safe detokenization and the model's chat template.

A tokenizer comes from a Hugging Face folder (tokenizer.json + tokenizer_config.json) or
from a GGUF file's metadata (byte-level BPE from `tokenizer.ggml.*`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from spruce.runtime.core.values import TokenBound
from spruce.runtime.errors import ModelLoadError

# llama.cpp pre-tokenizer names whose regex splits every digit on its own before the
# GPT-2 split (llama-vocab.cpp groups "smollm" with starcoder, refact, codeshell...).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# How many bytes of text a normalizer may turn into one: NFC composes at most 3 bytes into 1
# (Hangul jamo L + V + T, 9 bytes, into one 3-byte syllable); none for no normalizer.
_NORMALIZER_SHRINK = {None: 1, "NFC": 3}
_NEVER_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}  # bytes that no UTF-8 text holds
_KEEPS_EVERY_BYTE = {"ByteLevel", "Digits", "Split", "Sequence"}  # pre-tokenizers that drop nothing


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (char -> byte)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def split_specials(text: str, specials: Iterable[str]) -> list[str]:
    """`text` cut into pieces that are each a special token's text (one of `specials`) or
    text between them (no empty pieces); the longest special wins where several match."""
    found = sorted((t for t in specials if t in text), key=len, reverse=True)
    if not found:
        return [text] if text else []
    return [p for p in re.split("(" + "|".join(map(re.escape, found)) + ")", text) if p]


class Tokenizer:
    """The runtime's one tokenizer interface.

    `eos_token_ids` are the ids that end generation; `token_bytes()` gives the raw bytes
    each id stands for (special tokens map to their text, for masking they are excluded by
    the caller through `special_token_ids`).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        specials = [t for t in backend.get_added_tokens_decoder().items() if t[1].special]
        self.special_token_ids = frozenset(i for i, _ in specials)
        self.special_tokens = {t.content: i for i, t in specials}  # text -> id
        self._byte_level = _is_byte_level(backend)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str, config: dict[str, Any] | None = None) -> Tokenizer:
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(
                f"{folder} has no tokenizer.json (Spruce needs the fast tokenizer file)"
            )
        backend = tokenizers.Tokenizer.from_file(path)
        tok_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen_config = _read_json(os.path.join(folder, "generation_config.json"))
        config = config or _read_json(os.path.join(folder, "config.json"))
        bos = _token_id(backend, tok_config.get("bos_token")) or config.get("bos_token_id")
        eos = _as_list(gen_config.get("eos_token_id")) or _as_list(config.get("eos_token_id"))
        eos_tok = _token_id(backend, tok_config.get("eos_token"))
        eos = set(eos) | ({eos_tok} if eos_tok is not None else set())
        template = tok_config.get("chat_template") or _read_text(
            os.path.join(folder, "chat_template.jinja")
        )
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos_token=bool(tok_config.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        backend = _gguf_byte_level_bpe(meta)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        extra_eos = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in (eos, extra_eos) if i is not None],
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # -- encode / decode ------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids (with the BOS token first where the model adds one). The
        library's batch call tokenizes without holding the GIL (its `encode` holds it for the
        whole call: seconds for megabytes, every other thread of the process stopped), and
        keeps no offsets; its ids are `encode`'s."""
        ids = self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self) -> list[bytes]:
        """Raw bytes of every token id (what the token appends to the output)."""
        out = []
        for i in range(self.vocab_size):
            piece = self.backend.id_to_token(i)
            if piece is None:
                out.append(b"")
            elif i in self.special_token_ids:
                out.append(piece.encode())
            else:
                out.append(self._piece_bytes(piece))
        return out

    @cached_property
    def token_bound(self) -> TokenBound | None:
        """What any text's token count is at least, known from its bytes (None where this
        tokenizer gives no bound): a prompt that cannot fit the context is refused before it
        is tokenized. Byte-level BPE keeps every byte of the (normalized) text in some token
        but the bytes without a token of their own (the bundled model has none for six ASCII
        control characters, and for the lead bytes of unassigned planes): a token stands for
        at most its longest token's bytes (an added token's text included) times what the
        normalizer may shrink. Other tokenizers may drop text (a whitespace pre-tokenizer, an
        added token that strips the spaces beside it) or stand one unknown token for a long
        word."""
        spec = json.loads(self.backend.to_str())
        shrink = _normalizer_shrink(spec.get("normalizer"))
        added = self.backend.get_added_tokens_decoder().values()
        if not (
            self._byte_level
            and (spec.get("model") or {}).get("type") == "BPE"
            and shrink is not None
            and _keeps_every_byte(spec.get("pre_tokenizer"))
            and not any(t.lstrip or t.rstrip for t in added)
        ):
            return None
        dropped = _bytes_without_token(self.backend)
        longest = max(
            max(map(len, self.token_bytes()), default=1),
            max((len(t.content.encode()) for t in added), default=1),
        )
        ascii_dropped = "".join(chr(b) for b in dropped if b < 0x80)
        wide_dropped = any(b >= 0x80 and b not in _NEVER_UTF8 for b in dropped)
        return TokenBound(longest * shrink, ascii_dropped, ascii_only=wide_dropped)

    def _piece_bytes(self, piece: str) -> bytes:
        if self._byte_level:
            table = _byte_level_alphabet()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    # -- chat template ----------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, rendered as transformers renders it: `tools` and `documents` as
        given, the special tokens by name, `template_kwargs` (e.g. enable_thinking=False) as
        more variables."""
        if not self.chat_template:
            raise ValueError("this model ships no chat template; send a plain prompt instead")
        template = compile_chat_template(self.chat_template)
        return template.render(
            **template_kwargs,
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    @property
    def bos_token(self) -> str:
        return self._special_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._special_text(min(self.eos_token_ids, default=None))

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never end in a broken
    UTF-8 character. Decodes a small window (prefix_offset..) so that tokenizers which
    strip a leading space still join pieces correctly."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Appends ids; returns the newly complete text (possibly empty)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is held back (a trailing broken character)."""
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        prefix_text = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


# -- helpers ---------------------------------------------------------------------------


def _gguf_byte_level_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise ModelLoadError(f"the GGUF file's tokenizer metadata is inconsistent: {e}") from None
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(split)
    backend.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(tokens[i], special=types[i] == _GGUF_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    backend.add_tokens(added)
    return backend


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many bytes of text the normalizer may turn into one (None: no bound known)."""
    if normalizer is not None and normalizer.get("type") == "Sequence":
        factors = [_normalizer_shrink(n) for n in normalizer.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    return _NORMALIZER_SHRINK.get(None if normalizer is None else normalizer.get("type"))


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    """Whether the pre-tokenizer splits text without dropping any of it."""
    if pre_tokenizer is None:
        return True
    if (
        pre_tokenizer.get("type") not in _KEEPS_EVERY_BYTE
        or pre_tokenizer.get("behavior") == "Removed"
    ):
        return False
    return all(_keeps_every_byte(p) for p in pre_tokenizer.get("pretokenizers", []))


def _bytes_without_token(backend: tokenizers.Tokenizer) -> list[int]:
    """The bytes that have no token of their own (a byte-level BPE drops them)."""
    return [b for c, b in _byte_level_alphabet().items() if backend.token_to_id(c) is None]


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return "ByteLevel" in json.dumps(decoder)


def _token_id(backend: tokenizers.Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_text(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with
    it for training masks): renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# What the server passes to every chat template; request kwargs may not replace them.
TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers renders it (sandboxed Jinja, trimmed
    blocks, loop controls, the generation tag, tojson with its keywords, raise_exception,
    strftime_now); cached by source. A syntax error is a jinja2.TemplateError."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_chat_template(path: str) -> str:
    """A chat template file (--chat-template): Jinja text, or a JSON file with a
    "chat_template" key (a tokenizer_config.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ModelLoadError(f"cannot read the chat template {path}: {e.strerror}") from None
    if path.endswith(".json"):
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if not isinstance(template, str):
            raise ModelLoadError(f'{path} has no "chat_template" string')
        return template
    try:
        compile_chat_template(text)
    except jinja2.TemplateError as e:
        raise ModelLoadError(f"the chat template {path} does not compile: {e}") from None
    return text
