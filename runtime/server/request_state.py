"""One request in flight, as the front end sees it (`RequestState`: its output rebuilt
from the scheduler's updates, text and meta_info made here), and the `Event`s a caller
reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spruce.runtime.core.update import ReqUpdate
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.text.detokenizer import LOGPROB_KEYS, RequestOutput

if TYPE_CHECKING:
    from spruce.runtime.server.request_manager import Call


@dataclass(slots=True)
class Event:
    """One piece of news for a caller. Streaming: `text` / `output_ids` are what is new;
    otherwise (and in `result`, once finished) the whole output."""

    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    result: dict[str, Any] | None = None  # {"text", "output_ids", "meta_info"} when finished
    error: str | None = None  # the request failed: the message
    status: int = 200  # with error: an HTTP status


class RequestState:
    """One request in flight: its output (`RequestOutput`) and where its events go."""

    __slots__ = (
        "aborted", "call", "client", "client_rid", "done", "error", "index", "output",
        "prompt_tokens", "replica", "rid", "stream",
    )  # fmt: skip

    def __init__(
        self, rid: str, client_rid: str, index: int, call: Call, valid: ValidRequest,
        client: str = "",
    ) -> None:  # fmt: skip
        self.rid, self.client_rid, self.index, self.call = rid, client_rid, index, call
        self.client = client
        self.prompt_tokens = len(valid.input_ids)  # counted against --max-tokens-per-client
        self.output = RequestOutput(call.tokenizer, valid, client_rid)
        self.stream = valid.options.stream
        self.replica = 0  # the scheduler replica it runs on
        self.done = False
        self.aborted = False  # the front end asked for the abort (client gone, shutdown)
        self.error: tuple[int, str] | None = None  # aborted as a failure: (status, message)

    def apply(self, u: ReqUpdate) -> Event:
        output = self.output
        delta = output.apply(u)
        reason = output.finish_reason
        if reason is not None:
            self.done = True
            if reason.type == "abort" and self.error is not None:
                return Event(self.index, error=self.error[1], status=self.error[0])
            if reason.type == "abort" and not self.aborted:
                return self._refused(reason.message or "the request was aborted")
        new_ids = output.text.new_output_ids()
        if not self.stream:
            return self._final(Event(self.index, output.text.text, list(output.ids)), u)
        event = Event(self.index, delta, new_ids, output.chunk_meta(u))
        return self._final(event, u) if self.done else event

    def _refused(self, message: str) -> Event:
        """The scheduler aborted the request by itself (e.g. its constraint did not compile):
        an error for the caller, a 400 when nothing was generated."""
        return Event(self.index, error=message, status=400 if not self.output.ids else 500)

    def _final(self, event: Event, u: ReqUpdate) -> Event:
        meta = self.output.meta_info()
        if self.stream:  # a chunk's logprobs are those of its own tokens
            chunk = self.output.chunk_meta(u)
            event.meta_info = {k: v for k, v in meta.items() if k not in LOGPROB_KEYS}
            event.meta_info.update((k, v) for k, v in chunk.items() if k in LOGPROB_KEYS)
        else:
            event.meta_info = meta
        event.finished = True
        event.result = {
            "text": self.output.text.text,
            "output_ids": list(self.output.ids),
            "meta_info": meta,
        }
        if self.output.embedding is not None:
            event.result["embedding"] = self.output.embedding
        return event
