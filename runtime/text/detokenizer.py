"""Request output text: incremental, UTF-8 safe, stop strings trimmed, and the response
dict (text, output_ids, meta_info) that the Engine and the server return."""

from __future__ import annotations

from typing import Any

from spruce.constrained.report import schema_report
from spruce.runtime.core.request import Req
from spruce.runtime.text.stop import find_stop, stop_prefix_len
from spruce.runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """Tracks one request's visible text. `update(req)` returns the text to send now:
    never half a character, never text that may turn out to start a stop string, never
    the stop string or stop token itself."""

    def __init__(self, tokenizer: Tokenizer, req: Req) -> None:
        self.tokenizer = tokenizer
        self.skip_special = req.sampling.skip_special_tokens
        self.stops = req.sampling.stop
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
        if not self.stops:
            return text
        found = find_stop(text, self.stops)
        if found is not None:
            return text[: found[0]]
        return text if finished else text[: len(text) - stop_prefix_len(text, self.stops)]

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
    return schema_report(req.constraint, data.decode("utf-8", errors="replace"))


def _pairs(top):
    return None if top is None else [list(x) for x in top]
