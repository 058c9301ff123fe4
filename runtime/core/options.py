"""RequestOptions: how a caller wants a request's results (logprobs, streaming, deadline), as
one record passed by name from every front end to the scheduler. Sampling and stopping live in
`SamplingParams`; this is the rest of a generate call's per-request options."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1 = output only
    top_logprobs_num: int = 0  # alternatives per position, with return_logprob
    return_text_in_logprobs: bool = False  # logprob entries carry the token's text (native routes)
    stream: bool = False
    timeout_s: float | None = None  # deadline from arrival; the server aborts the request then

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOptions:
        """From a JSON-like dict that may hold other keys too (only this record's are read)."""
        return cls(**{name: data[name] for name in cls.field_names() if name in data})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
