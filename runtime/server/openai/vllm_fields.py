"""vLLM's structured-output fields on the OpenAI routes, as SamplingParams constraints:

    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's names before v0.12)
    guided_decoding_backend: "auto" | "guidance" | "outlines"   (the request's grammar_backend)

`grammar` text is Lark when llguidance's `is_lark_syntax` says so (a line that starts with
`start:` or `%llguidance`, as vLLM's guidance backend decides), else EBNF / GBNF
(`root ::= ...`, the dialect of vLLM's XGrammar backend).
"""

from __future__ import annotations

from typing import Any

from llguidance.gbnf_to_lark import is_lark_syntax

from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.openai.tool_tags import ANY_OBJECT

# vLLM's names -> SamplingParams fields ("grammar": ebnf or lark, by its text)
GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choices",
    "guided_grammar": "grammar",
}
# vLLM's backend names -> this server's (xgrammar and lm-format-enforcer are not here)
VLLM_BACKENDS = {"auto": "auto", "guidance": "llguidance", "llguidance": "llguidance",
                 "outlines": "outlines", "spruce": "spruce"}  # fmt: skip
BACKEND_FIELD = "guided_decoding_backend"
STRUCTURED_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choices", "grammar": "grammar",
                     "structural_tag": "structural_tag"}  # fmt: skip


def grammar_field(text: Any) -> str:
    """ "lark" for a grammar in Lark syntax, else "ebnf" (a non-string is left for
    SamplingParams to refuse, as ebnf)."""
    return "lark" if isinstance(text, str) and is_lark_syntax(text) else "ebnf"


def vllm_constraints(extra: dict[str, Any], structured: Any) -> list[tuple[str, dict[str, Any]]]:
    """(the name the request gave it by, {SamplingParams field: value}) for each vLLM
    constraint given; the guided_* fields are taken out of `extra`."""
    out = [
        (name, _field(GUIDED_FIELDS[name], extra.pop(name)))
        for name in list(extra)
        if name in GUIDED_FIELDS
    ]
    if structured is None:
        return out
    for key, name in STRUCTURED_FIELDS.items():
        value = structured.json_ if key == "json" else getattr(structured, key)
        if value is not None:
            out.append((f"structured_outputs.{key}", _field(name, value)))
    if structured.json_object:
        out.append(("structured_outputs.json_object", {"json_schema": ANY_OBJECT}))
    return out


def _field(name: str, value: Any) -> dict[str, Any]:
    return {grammar_field(value) if name == "grammar" else name: value}


def vllm_backend(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with vLLM's guided_decoding_backend as the request's grammar_backend; a
    backend this server does not have is a 400 naming the field."""
    if BACKEND_FIELD not in extra:
        return extra
    out = dict(extra)
    value = out.pop(BACKEND_FIELD)
    if "grammar_backend" in out:
        raise ApiError(
            400, f"give {BACKEND_FIELD} or grammar_backend, not both", param=BACKEND_FIELD
        )
    if value not in VLLM_BACKENDS:
        known = ", ".join(VLLM_BACKENDS)
        message = f"{BACKEND_FIELD} {value!r} is not available on this server; use one of {known}"
        raise ApiError(400, message, param=BACKEND_FIELD)
    out["grammar_backend"] = VLLM_BACKENDS[value]
    return out
