"""The tokenizer's vocabulary as the constrained decoder sees it, built once per compiler."""

from __future__ import annotations

import pickle
from typing import NamedTuple, Protocol

import outlines_core

from spruce.constrained.bitmask import num_words, pack_token_ids
from spruce.constrained.patterns import END_MARK

_END_MARK_BYTES = END_MARK.encode()
SAMPLE_EVERY = 16  # the vocabulary sample holds every 16th token (and every single byte)...
MIN_SAMPLED_SIZE = 8192  # ...of a vocabulary at least this large (a smaller one is its own sample)


class VocabularySample(NamedTuple):
    """A small vocabulary for estimating the size of an index before building it: an index
    built on `vocabulary` holds about 1 / `scale` of the transitions (and bytes) of the full
    vocabulary's index, since each state's transitions are one per allowed token.
    Measured on the bundled tokenizer and the shared schemas: the estimate of the binary
    form is 1.16-1.32x the full index's (the sample reaches a few more states)."""

    vocabulary: outlines_core.Vocabulary
    scale: float


class _TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def token_bytes(self) -> list[bytes]: ...


class TokenVocabulary:
    """Raw bytes of every id below `vocab_size` (the model's logits width, which may exceed
    the tokenizer's: extra ids have no bytes and are never allowed), the EOS ids, and the
    outlines-core `Vocabulary`: EOS and other special tokens excluded, plus the virtual
    `end_mark_id` (= vocab_size, never a model id) for the end marker (see patterns.py).

    Tokens that could spell the end marker are left out too: those containing it and those
    ending in a proper prefix of its bytes (F4, F4 8F, F4 8F BF). The cost: characters of
    plane 16 (private use) cannot be split across such tokens. `sample`: see
    VocabularySample. Immutable."""

    def __init__(self, tokenizer: _TokenizerLike, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.num_words = num_words(self.vocab_size)
        self.eos_token_ids = frozenset(i for i in tokenizer.eos_token_ids if i < self.vocab_size)
        if not self.eos_token_ids:
            raise ValueError(
                "the tokenizer has no EOS token below vocab_size; constraints need one to end"
            )
        excluded = tokenizer.special_token_ids | self.eos_token_ids
        raw = tokenizer.token_bytes()
        self.token_bytes = [
            b"" if i >= len(raw) or i in excluded else raw[i] for i in range(self.vocab_size)
        ]
        ids_by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(self.token_bytes):
            if data and not _may_spell_end_mark(data):
                ids_by_bytes.setdefault(data, []).append(token_id)
        self.end_mark_id = self.vocab_size
        ids_by_bytes[_END_MARK_BYTES] = [self.end_mark_id]
        self.outlines_eos = min(self.eos_token_ids)
        self.vocabulary = _compacted(outlines_core.Vocabulary(self.outlines_eos, ids_by_bytes))
        self.sample = self._sample(ids_by_bytes)
        self.eos_mask = pack_token_ids(sorted(self.eos_token_ids), self.vocab_size)

    def _sample(self, ids_by_bytes: dict[bytes, list[int]]) -> VocabularySample:
        """Every SAMPLE_EVERY-th token, plus each single byte under an id of its own above
        the end marker's (so that every state a string can reach is reached), plus the end
        marker. The bytes are scaled like the sampled tokens: the estimate errs high (by
        about 256 / (vocabulary size / SAMPLE_EVERY): 8% for 49k tokens)."""
        real = sum(len(ids) for data, ids in ids_by_bytes.items() if data != _END_MARK_BYTES)
        if real < MIN_SAMPLED_SIZE:
            return VocabularySample(self.vocabulary, 1.0)
        sampled: dict[bytes, list[int]] = {}
        for data, ids in ids_by_bytes.items():
            if data == _END_MARK_BYTES:
                continue
            for token_id in ids:
                if token_id % SAMPLE_EVERY == 0:
                    sampled.setdefault(data, []).append(token_id)
        picked = sum(len(ids) for ids in sampled.values())
        for byte in range(256):
            sampled.setdefault(bytes([byte]), []).append(self.end_mark_id + 1 + byte)
        sampled[_END_MARK_BYTES] = [self.end_mark_id]
        vocabulary = outlines_core.Vocabulary(self.outlines_eos, sampled)
        return VocabularySample(vocabulary, real / max(picked, 1))


def _compacted(vocabulary: outlines_core.Vocabulary) -> outlines_core.Vocabulary:
    """The same vocabulary rebuilt from its binary form: index builds on the copy run 1.3-1.8x
    faster (measured with the bundled tokenizer's 49k tokens: 0.9-1.1 s vs 1.4-2.0 s for the
    `order` schema), presumably because its tokens lie together in memory. The bytes are
    made here and read back at once: nothing from outside this process is unpickled."""
    return pickle.loads(pickle.dumps(vocabulary))


def _may_spell_end_mark(data: bytes) -> bool:
    if _END_MARK_BYTES in data:
        return True
    return any(data.endswith(_END_MARK_BYTES[:k]) for k in range(1, len(_END_MARK_BYTES)))
