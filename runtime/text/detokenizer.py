"""A request's output as its caller sees it, rebuilt from the updates the runtime sends
(`core.update.ReqUpdate`): the output ids, the text (incremental, UTF-8 safe, stop strings
trimmed), the logprobs, and once finished the meta_info and the JSON-schema report. Used
by the server's front end and the offline Engine alike; the scheduler sends ids and counts,
and everything made of text is made here, off the scheduler's loop."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spruce.constrained.report import schema_report
from spruce.runtime.core.request import FinishReason
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.update import Finished, LogprobDelta, ReqUpdate
from spruce.runtime.text.stop import find_regex_stop, find_stop, stop_prefix_len
from spruce.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from spruce.runtime.core.validation import ValidRequest

CUSTOM_PARAMS_NOTE = "Spruce runs no custom logit processors; custom_params changed nothing"
LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
)


class OutputText:
    """Tracks one request's output ids and visible text. `apply(...)` returns the text to
    send now:
    never half a character, never text that may turn out to start a stop string, never
    the stop string, stop_regex match or stop token itself (with no_stop_trim: the text ends
    with it). A stop_regex match is trimmed once the request finished: a stream may have
    sent the start of the match already."""

    def __init__(
        self, tokenizer: Tokenizer, sampling: SamplingParams, prompt_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.stops = sampling.stop
        self.stop_regex = sampling.stop_regex
        self.keep_stop = sampling.no_stop_trim
        self.prompt_tail = prompt_ids[-4:]
        self.ids: list[int] = []  # the output ids so far
        self._restart([])
        self.sent = 0  # characters already returned
        self.sent_ids = 0  # output ids already returned

    def _restart(self, ids: list[int]) -> None:
        self.detok = IncrementalDetokenizer(
            self.tokenizer, self.prompt_tail, self.sampling.skip_special_tokens
        )
        self.first = len(self.detok.ids)  # the detokenizer's ids start with the prompt's tail
        self.detok.add(ids)

    def apply(self, rollback: int, new_ids: list[int], finish: FinishReason | None) -> str:
        """Drops the last `rollback` ids (jump-forward re-tokenized them), appends `new_ids`;
        returns the text to send now."""
        if rollback:
            del self.ids[len(self.ids) - rollback :]
        self.ids.extend(new_ids)
        ids = self._visible_ids(finish)
        seen = len(self.detok.ids) - self.first
        if rollback or len(ids) < seen:
            self._restart(ids)
        else:
            self.detok.add(ids[seen:])
        if finish is not None:
            self.detok.flush()
        visible = self._visible(self.detok.text, finish is not None)
        delta = visible[self.sent :] if len(visible) > self.sent else ""
        self.sent = max(self.sent, len(visible))
        return delta

    def _visible_ids(self, finish: FinishReason | None) -> list[int]:
        """Output ids whose text is shown: a stop token that ended the request is not."""
        stopped = finish is not None and finish.type == "stop" and isinstance(finish.matched, int)
        return self.ids[:-1] if stopped and not self.keep_stop else self.ids

    def _visible(self, text: str, finished: bool) -> str:
        end = self._stop_end(text, finished)
        if end is not None:
            return text[:end]
        if finished or not self.stops:
            return text
        return text[: len(text) - stop_prefix_len(text, self.stops)]

    def _stop_end(self, text: str, finished: bool) -> int | None:
        """Where the text ends at its first stop: the match's start (its end with no_stop_trim)."""
        matches = []
        found = find_stop(text, self.stops) if self.stops else None
        if found is not None:
            matches.append((found[0], found[0] + len(found[1])))
        regex_found = (
            find_regex_stop(text, self.stop_regex) if finished and self.stop_regex else None
        )
        if regex_found is not None:
            matches.append(regex_found[:2])
        if not matches:
            return None
        start, end = min(matches)
        return end if self.keep_stop else start

    @property
    def text(self) -> str:
        return self._visible(self.detok.text, True)

    def new_output_ids(self) -> list[int]:
        new = self.ids[self.sent_ids :]
        self.sent_ids = len(self.ids)
        return new


class RequestOutput:
    """One request's output on its caller's side: `apply(update)` for each ReqUpdate, in
    order; `meta_info()` once finished (`chunk_meta(update)` for a streamed chunk)."""

    def __init__(self, tokenizer: Tokenizer, valid: ValidRequest, rid: str) -> None:
        self.rid = rid
        self.valid = valid
        self.text = OutputText(tokenizer, valid.sampling, valid.input_ids)
        self.cached = 0
        self.logprobs = {key: [] for key in LOGPROB_KEYS} if valid.options.return_logprob else None
        self.finished: Finished | None = None

    @property
    def ids(self) -> list[int]:
        return self.text.ids

    @property
    def embedding(self) -> list[float] | None:
        """An embedding request's pooled vector (unnormalized), once finished."""
        return None if self.finished is None else self.finished.embedding

    @property
    def finish_reason(self) -> FinishReason | None:
        return None if self.finished is None else self.finished.reason

    def apply(self, update: ReqUpdate) -> str:
        """Takes one update; returns the text to send now."""
        self.cached = update.cached_tokens
        self.finished = update.finished
        if update.logprobs is not None and self.logprobs is not None:
            for key, entries in _logprob_items(update.logprobs):
                self.logprobs[key].extend(entries)
        return self.text.apply(update.rollback, update.new_ids, self.finish_reason)

    def chunk_meta(self, update: ReqUpdate) -> dict[str, Any]:
        """A streamed chunk's meta_info: counts so far and the logprobs of its own tokens."""
        reason = self.finish_reason
        meta = {
            "id": self.rid, "prompt_tokens": len(self.valid.input_ids),
            "completion_tokens": len(self.ids), "cached_tokens": self.cached,
            "finish_reason": None if reason is None else reason.to_dict(),
        }  # fmt: skip
        if update.logprobs is not None:
            meta.update(_logprob_items(update.logprobs))
        return meta

    def meta_info(self) -> dict[str, Any]:
        """The finished request's meta_info (the logprobs of all its tokens)."""
        done = self.finished
        assert done is not None, "meta_info of a request that has not finished"
        info: dict[str, Any] = {
            "id": self.rid, "prompt_tokens": len(self.valid.input_ids),
            "completion_tokens": len(self.ids), "cached_tokens": self.cached,
            "finish_reason": done.reason.to_dict(), "e2e_latency": done.e2e_s,
            "jump_forward_tokens": done.jump_forward_tokens,
        }  # fmt: skip
        if done.spec_draft_tokens:
            info["spec_draft_tokens"] = done.spec_draft_tokens
            info["spec_accepted_tokens"] = done.spec_accepted_tokens
        if self.valid.sampling.custom_params is not None:
            info["ignored"] = {"custom_params": CUSTOM_PARAMS_NOTE}
        report = self._schema_report()
        if report is not None:
            info["json_schema"] = report
        if self.logprobs is not None:
            top = self.valid.options.top_logprobs_num > 0
            info.update((k, v) for k, v in self.logprobs.items() if top or "top" not in k)
        return info

    def _schema_report(self) -> dict[str, Any] | None:
        """The keywords the compiled grammar did not enforce, and whether the output
        validates: the output as the grammar saw it (its tokens' bytes, special tokens
        none)."""
        constraint, done = self.valid.constraint, self.finished
        if constraint is None or done is None or done.unenforced is None:
            return None
        token_bytes = grammar_bytes(self.text.tokenizer)
        data = b"".join(token_bytes[i] for i in self.ids if i < len(token_bytes))
        spec = replace(constraint, unenforced=tuple(done.unenforced))
        return schema_report(spec, data.decode("utf-8", errors="replace"))


@functools.lru_cache(maxsize=4)
def grammar_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes as a grammar sees them: special tokens and EOS have none."""
    excluded = tokenizer.special_token_ids | frozenset(tokenizer.eos_token_ids)
    return [b"" if i in excluded else b for i, b in enumerate(tokenizer.token_bytes())]


def _logprob_items(delta: LogprobDelta) -> list[tuple[str, list]]:
    """The delta's entries under their meta_info keys (those it has)."""
    items = [("output_token_logprobs", delta.output)]
    if delta.output_top is not None:
        items.append(("output_top_logprobs", delta.output_top))
    if delta.prompt is not None:
        items.append(("input_token_logprobs", delta.prompt))
    if delta.prompt_top is not None:
        items.append(("input_top_logprobs", delta.prompt_top))
    return items
