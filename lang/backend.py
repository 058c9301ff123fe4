"""What the interpreter needs from a runtime: the base class of every backend.

Requests and replies are the ZeroMQ protocol's own messages (spruce.runtime.protocol.dsl):
a backend takes a `GenerateMsg` and answers with a `FinalMsg` (`results` for a batch) or,
streaming, with `ChunkMsg`s and then one `FinalMsg`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from functools import cached_property
from typing import Any

from spruce.lang.chat import ChatTemplate
from spruce.lang.errors import UnsupportedFeatureError
from spruce.runtime.protocol.dsl import ChunkMsg, FinalMsg, GenerateMsg


def new_rid() -> str:
    return uuid.uuid4().hex


class Backend:
    """A runtime the DSL can run programs on. Must be safe to call from many threads."""

    def model_info(self) -> dict[str, Any]:
        """The runtime's model_info: "model", "context_length", "chat_template", ..."""
        raise NotImplementedError

    def generate(self, msg: GenerateMsg) -> FinalMsg:
        """Runs one request (or a batch: `text` / `input_ids` a list) to the end. Raises
        RuntimeRequestError with the runtime's message when it refuses."""
        raise NotImplementedError

    def generate_stream(self, msg: GenerateMsg) -> Iterator[ChunkMsg | FinalMsg]:
        """Chunks of new text as they come, then the FinalMsg. Closing the iterator early
        aborts the request."""
        raise NotImplementedError

    def flush_cache(self) -> None:
        raise NotImplementedError

    def get_server_info(self) -> dict[str, Any]:
        """The server's configuration and statistics (the HTTP transport has them)."""
        raise UnsupportedFeatureError(
            f"{type(self).__name__} cannot read the server info; use an http:// RuntimeEndpoint "
            "or sl.Runtime(...).get_server_info()"
        )

    def close(self) -> None:
        """Releases the connection (a backend that owns nothing does nothing)."""

    # -- shared helpers ---------------------------------------------------------------------

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        return ChatTemplate.from_model_info(self.model_info())

    def commit(self, text: str) -> dict[str, Any]:
        """Fills the runtime's prefix cache with `text` (a zero-output request); returns its
        meta_info (prompt_tokens, cached_tokens...)."""
        msg = GenerateMsg(rid=new_rid(), text=text, sampling_params={"max_new_tokens": 0})
        return self.generate(msg).meta_info or {}
