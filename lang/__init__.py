"""spruce.lang: the structured-generation DSL, with SGLang's names and argument orders.

import spruce.lang as sl

@sl.function
def qa(s, question):
    s += sl.user(question)
    s += sl.assistant(sl.gen("answer", max_tokens=32))

sl.set_default_backend(sl.Runtime())          # or sl.RuntimeEndpoint("tcp://127.0.0.1:30001"),
                                              # or sl.RuntimeEndpoint("http://127.0.0.1:30000")
state = qa.run(question="What is the capital of France?", temperature=0)
print(state["answer"])
"""

from __future__ import annotations

from spruce.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from spruce.lang.backend import Backend
from spruce.lang.choices import (
    ChoicesDecision,
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from spruce.lang.endpoint import RuntimeEndpoint
from spruce.lang.errors import (
    ProgramError,
    RuntimeRequestError,
    RuntimeUnavailableError,
    UnsupportedFeatureError,
)
from spruce.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from spruce.lang.launcher import Runtime
from spruce.lang.program import Program, function, get_default_backend, set_default_backend
from spruce.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Backend",
    "ChoicesDecision",
    "ChoicesMethod",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "RuntimeRequestError",
    "RuntimeUnavailableError",
    "UnsupportedFeatureError",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
