"""Request output text: incremental, UTF-8 safe, stop strings trimmed, and the response
dict (text, output_ids, meta_info) that the Engine and the server return."""

from __future__ import annotations

from typing import Any

from spruce.constrained.report import schema_report
from spruce.runtime.core.request import Req
from spruce.runtime.text.stop import find_regex_stop, find_stop, stop_prefix_len
from spruce.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

CUSTOM_PARAMS_NOTE = "Spruce runs no custom logit processors; custom_params changed nothing"


class OutputText:
    """Tracks one request's visible text. `update(req)` returns the text to send now:
    never half a character, never text that may turn out to start a stop string, never
    the stop string, stop_regex match or stop token itself (with no_stop_trim: the text ends
    with it). A stop_regex match is trimmed once the request finished: a stream may have
    sent the start of the match already."""

    def __init__(self, tokenizer: Tokenizer, req: Req) -> None:
        self.tokenizer = tokenizer
        self.skip_special = req.sampling.skip_special_tokens
        self.stops = req.sampling.stop
        self.stop_regex = req.sampling.stop_regex
        self.keep_stop = req.sampling.no_stop_trim
        self.prompt_tail = req.prompt_ids[-4:]
        self._restart([])
        self.sent = 0  # characters already returned
        self.sent_ids = 0  # output ids already returned

    def _restart(self, ids: list[int]) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.prompt_tail, self.skip_special)
        self.first = len(self.detok.ids)  # the detokenizer's ids start with the prompt's tail
        self.detok.add(ids)

    def update(self, req: Req) -> str:
        ids = _visible_ids(req)
        seen = self.detok.ids[self.first :]
        if ids[: len(seen)] != seen:  # jump-forward re-tokenized earlier tokens
            self._restart(ids)
        elif len(ids) > len(seen):
            self.detok.add(ids[len(seen) :])
        if req.finished:
            self.detok.flush()
        visible = self._visible(self.detok.text, req.finished)
        delta = visible[self.sent :] if len(visible) > self.sent else ""
        self.sent = max(self.sent, len(visible))
        return delta

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

    def new_output_ids(self, req: Req) -> list[int]:
        new = req.output_ids[self.sent_ids :]
        self.sent_ids = len(req.output_ids)
        return new


def _visible_ids(req: Req) -> list[int]:
    """Output ids whose text is shown: a stop token that ended the request is not."""
    reason = req.finish_reason
    if req.sampling.no_stop_trim:
        return req.output_ids
    if reason is not None and reason.type == "stop" and isinstance(reason.matched, int):
        return req.output_ids[:-1]
    return req.output_ids


def meta_info(req: Req) -> dict[str, Any]:
    end = req.finished_at
    info: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens or 0,
        "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
        "e2e_latency": (end - req.created_at) if end is not None else None,
        "jump_forward_tokens": req.jump_forward_tokens,
    }
    if req.sampling.custom_params is not None:
        info["ignored"] = {"custom_params": CUSTOM_PARAMS_NOTE}
    report = _schema_report(req)
    if report is not None:
        info["json_schema"] = report
    if req.logprobs is not None:
        lp = req.logprobs
        info["input_token_logprobs"] = [list(x) for x in lp.input_token_logprobs]
        info["output_token_logprobs"] = [list(x) for x in lp.output_token_logprobs]
        if req.options.top_logprobs_num:
            info["input_top_logprobs"] = [_pairs(t) for t in lp.input_top_logprobs]
            info["output_top_logprobs"] = [_pairs(t) for t in lp.output_top_logprobs]
    return info


def _schema_report(req: Req) -> dict[str, Any] | None:
    """Once a JSON-schema request finishes: the keywords its grammar did not enforce and
    whether the output validates (the output is decoded from the grammar's token bytes)."""
    if not req.finished or req.constraint is None or req.cursor is None:
        return None
    token_bytes = req.cursor.grammar.vocab.token_bytes
    data = b"".join(token_bytes[i] for i in req.output_ids if i < len(token_bytes))
    return schema_report(
        req.cursor.grammar.spec, data.decode("utf-8", errors="replace")
    )  # the compiled spec: decided


def _pairs(top):
    return None if top is None else [list(x) for x in top]
