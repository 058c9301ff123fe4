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

    @classmethod
    def from_keywords(
        cls, given: dict[str, Any], where: str, left_out: tuple[str, ...] = ()
    ) -> RequestOptions:
        """From a call's keyword arguments (`where(**given)`), which must be fields of this
        record but `left_out`; anything else is a TypeError listing the ones taken."""
        known = [name for name in cls.field_names() if name not in left_out]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise TypeError(
                f"{where}() got unexpected keyword argument(s) {unknown}; options: {', '.join(known)}"
            )
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Options only a server carries out: the deadline (its front end watches it) and logprob
# entries with their text (the native routes' presentation). The offline Engine refuses them.
SERVER_ONLY = ("return_text_in_logprobs", "timeout_s")
