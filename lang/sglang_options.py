"""SGLang's server options (`sgl.Runtime(...)` keywords, `python -m sglang.launch_server`
flags) translated to Spruce's, for `sl.Runtime(**options)`.

Three kinds: options with the same name and meaning pass through (context_length,
tp_size, nnodes, node_rank, dist_init_addr, chunked_prefill_size, schedule_policy, disable_radix_cache, max_running_requests,
attention_backend, kv_cache_dtype, dtype, device, ...); options with another Spruce name are
renamed (RENAMED), some values too (VALUE_ALIASES); options with no Spruce meaning are an
error that says why (NO_EQUIVALENT), unless given at the value that changes nothing
(HARMLESS_VALUES). Anything else stays an unknown option for the launcher to refuse.
"""

from __future__ import annotations

from typing import Any

from spruce.lang.errors import ProgramError

RENAMED = {
    # SGLang: share of GPU memory for weights + KV pool; Spruce: share of the free GPU
    # memory (after the weights) for the KV pool. The same knob: how much KV to allocate.
    "mem_fraction_static": "gpu_memory_fraction",
    "random_seed": "seed",
    "disable_regex_jump_forward": "disable_jump_forward",
    "constrained_json_whitespace_pattern": "grammar_whitespace_pattern",
    "dp_size": "dp",  # data-parallel scheduler replicas behind one server
}

VALUE_ALIASES = {
    "dtype": {"half": "float16", "float": "float32"},
    "kv_cache_dtype": {"fp16": "float16", "bf16": "bfloat16"},
    "attention_backend": {"torch_native": "native"},
}

HARMLESS_VALUES = {
    "trust_remote_code": False,
    "skip_tokenizer_init": False,
}

NO_EQUIVALENT = {
    "trust_remote_code": "Spruce runs its own model code, never a repository's",
    "skip_tokenizer_init": "Spruce always tokenizes in the server",
    "tokenizer_path": "the tokenizer is read from the model path",
    "max_prefill_tokens": "use chunked_prefill_size (Spruce's prefill tokens per step, all requests together)",
    "max_total_tokens": "size the KV pool with kv_memory_gb (or mem_fraction_static on a GPU)",
    "enable_torch_compile": "Spruce does not compile the model with torch.compile",
    "stream_interval": "Spruce streams every step's new text",
    "schedule_conservativeness": "Spruce reserves room for future output tokens with decode_reserve_ratio",
}


def translate_sglang_options(options: dict[str, Any]) -> dict[str, Any]:
    """SGLang option names and values -> Spruce's; ProgramError for SGLang options that
    have no Spruce meaning. Spruce's own options pass through unchanged."""
    out = {}
    for key, value in options.items():
        if key in NO_EQUIVALENT:
            _check_harmless(key, value)
            continue
        name = RENAMED.get(key, key)
        if name in out:
            raise ProgramError(f"runtime option {name!r} given twice (as {key!r} too)")
        out[name] = (
            VALUE_ALIASES.get(name, {}).get(value, value) if isinstance(value, str) else value
        )
    _check_kv_cache_dtype(out.get("kv_cache_dtype"))
    return out


def _check_harmless(key: str, value: Any) -> None:
    if key in HARMLESS_VALUES and value == HARMLESS_VALUES[key]:
        return
    raise ProgramError(
        f"SGLang option {key}={value!r} has no Spruce equivalent: {NO_EQUIVALENT[key]}"
    )


def _check_kv_cache_dtype(value: Any) -> None:
    if isinstance(value, str) and value.startswith("fp8"):
        raise ProgramError(
            f"kv_cache_dtype={value!r}: Spruce keeps the KV cache in auto, float16, bfloat16, float32 or int8 on the CPU (no fp8)"
        )
