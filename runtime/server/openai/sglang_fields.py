"""SGLang's extension fields on the OpenAI routes: which extra body fields are accepted,
under which SamplingParams names, and `continue_final_message` for chat prompts.

SGLang's clients send these with the openai client's `extra_body={...}`. Sampling fields
are SamplingParams' own names (top_k, min_p, repetition_penalty, regex, stop_token_ids,
ignore_eos, skip_special_tokens, no_stop_trim, stop_regex, logit_bias, ...) plus the
aliases `min_tokens` (SGLang's and vLLM's) and `include_stop_str_in_output` (vLLM's);
anything else unknown stays a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from spruce.runtime.server.http.common import ApiError

# SGLang / vLLM names on the OpenAI routes -> SamplingParams field names
SAMPLING_ALIASES = {"min_tokens": "min_new_tokens", "include_stop_str_in_output": "no_stop_trim"}
# Accepted, changing nothing in how this server generates (`rid`: SGLang's request id, for logs).
ACCEPTED_FIELDS = {"rid"}


def renamed(extra: dict[str, Any]) -> dict[str, Any]:
    """The extra fields with SGLang's aliases renamed; both an alias and its field is a 400."""
    out = dict(extra)
    for alias, name in SAMPLING_ALIASES.items():
        if alias in out:
            if name in out:
                raise ApiError(400, f"give {alias} or {name}, not both", param=alias)
            out[name] = out.pop(alias)
    return out


def continued(text: str, final_content: str) -> str:
    """A chat prompt rendered with the final assistant message, cut right after that
    message's text: the model continues it instead of starting a new turn."""
    content = final_content.strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise ApiError(
            400, "continue_final_message: the chat template does not show the final message's text",
            param="continue_final_message",
        )  # fmt: skip
    return text[: at + len(content)]


def check_continue_final(messages: list[Any], continue_final_message: bool) -> None:
    if continue_final_message and (not messages or messages[-1].role != "assistant"):
        raise ApiError(
            400,
            "continue_final_message needs an assistant message last",
            param="continue_final_message",
        )
