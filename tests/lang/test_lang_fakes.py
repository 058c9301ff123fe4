"""A small in-test backend for the DSL's unit tests (no model, no server; no tests here).

`FakeBackend` answers the protocol's GenerateMsg like a runtime would: a GPT-2-like word
tokenizer (a space joins the next word, so "is " + "Paris" merges at the boundary),
deterministic logprobs from the previous token, deterministic outputs, stop strings, a
prefix cache that reports cached_tokens, streaming, and a record of every request.
"""

from __future__ import annotations

import re
import threading
import time
import zlib

from spruce.lang.backend import Backend
from spruce.lang.errors import RuntimeRequestError
from spruce.runtime.protocol.dsl import ChunkMsg, FinalMsg, GenerateMsg

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
_PIECES = re.compile(r" ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+")


class FakeTokenizer:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.pieces: list[str] = []
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return [self._id(p) for p in _PIECES.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def _id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]


def fake_logprob(prev: int, token: int) -> float:
    return -((zlib.crc32(f"{prev}|{token}".encode()) % 1000) / 250.0) - 0.01


class FakeBackend(Backend):
    def __init__(self, chat_template: str | None = CHATML, delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.template_source = chat_template
        self.delay = delay
        self.requests: list[GenerateMsg] = []
        self.cache: set[tuple[int, ...]] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushed = 0
        self._lock = threading.Lock()

    def model_info(self) -> dict:
        return {"model": "fake", "context_length": 4096, "chat_template": self.template_source}

    def flush_cache(self) -> None:
        self.flushed += 1
        self.cache.clear()

    # -- generate -----------------------------------------------------------------------------

    def generate(self, msg: GenerateMsg) -> FinalMsg:
        self._record(msg)
        try:
            prompts, single = self._prompts(msg)
            results = [self._one(p, msg) for p in prompts]
        finally:
            with self._lock:
                self.in_flight -= 1
        if single:
            return FinalMsg(msg.rid, **results[0])
        return FinalMsg(msg.rid, results=results)

    def generate_stream(self, msg: GenerateMsg):
        final = self.generate(msg)
        for token in final.output_ids:
            yield ChunkMsg(msg.rid, self.tokenizer.decode([token]), [token], {})
        yield final

    def _record(self, msg: GenerateMsg) -> None:
        with self._lock:
            self.requests.append(msg)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(self.delay)

    def _prompts(self, msg: GenerateMsg) -> tuple[list[list[int]], bool]:
        if msg.text is not None:
            texts = [msg.text] if isinstance(msg.text, str) else msg.text
            return [self.tokenizer.encode(t) for t in texts], isinstance(msg.text, str)
        batch = bool(msg.input_ids) and isinstance(msg.input_ids[0], list)
        return (msg.input_ids if batch else [msg.input_ids]), not batch

    def _one(self, ids: list[int], msg: GenerateMsg) -> dict:
        params = msg.sampling_params
        if not ids:
            raise RuntimeRequestError("the prompt is empty", 400)
        if params.get("regex") is not None:
            try:
                re.compile(params["regex"])
            except re.error as e:
                raise RuntimeRequestError(f"invalid regex {params['regex']!r}: {e}", 400) from None
        output = self._output(ids, params)
        meta = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(output),
            "cached_tokens": self._cached(ids),
            "finish_reason": {"type": "length", "matched": None},
        }
        if msg.return_logprob:
            meta["input_token_logprobs"] = self._prompt_logprobs(ids, msg.logprob_start_len)
            meta["output_token_logprobs"] = [
                [fake_logprob(p, t), t] for p, t in zip([*ids, *output], output)
            ]
        self._insert(ids + output)
        return {"text": self.tokenizer.decode(output), "output_ids": output, "meta_info": meta}

    def _output(self, ids: list[int], params: dict) -> list[int]:
        n = params.get("max_new_tokens", 128)
        if params.get("choices"):
            choices = params["choices"]
            return self.tokenizer.encode(
                choices[zlib.crc32(bytes(str(ids), "ascii")) % len(choices)]
            )
        seed = zlib.crc32(bytes(str(ids), "ascii"))
        text = "".join(" " + WORDS[(seed + i) % len(WORDS)] for i in range(n))
        for stop in params.get("stop") or ():
            if stop in text:
                text = text[: text.index(stop)]
        return self.tokenizer.encode(text)

    def _prompt_logprobs(self, ids: list[int], start: int) -> list[list]:
        if start < 0:
            return []
        out = []
        for pos in range(min(start, len(ids)), len(ids)):
            out.append([None if pos == 0 else fake_logprob(ids[pos - 1], ids[pos]), ids[pos]])
        return out

    def _cached(self, ids: list[int]) -> int:
        with self._lock:
            for n in range(len(ids) - 1, 0, -1):
                if tuple(ids[:n]) in self.cache:
                    return n
        return 0

    def _insert(self, ids: list[int]) -> None:
        with self._lock:
            for n in range(1, len(ids) + 1):
                self.cache.add(tuple(ids[:n]))

    # -- for assertions -----------------------------------------------------------------------

    def requests_where(self, **fields) -> list[GenerateMsg]:
        return [r for r in self.requests if all(getattr(r, k) == v for k, v in fields.items())]

    def token_logprobs(self, text: str) -> list[list]:
        """[[logprob, id], ...] of every token of `text` (the first has None)."""
        ids = self.tokenizer.encode(text)
        return self._prompt_logprobs(ids, 0)
