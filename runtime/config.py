"""Runtime configuration: a few frozen dataclasses, built once from options or the CLI.

`EngineConfig.from_options(**options)` routes each flat option (as the Engine, the server
CLI and the DSL's `Runtime(...)` accept them) to the one sub-config that owns it; an unknown
option is an error listing the known ones. `ServerOptions` are the server process's own.
Nothing mutates config after start-up. The CLI flags are derived from these fields
(`cli.py`).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from spruce.runtime.cores import default_threads
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.limits import RequestLimits, ServingLimits


@dataclass(frozen=True)
class ModelOptions:
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    quantization: str = "auto"  # CPU weights: auto (a GGUF's own where a kernel exists, else Q8_0; float stays float) | none | q8_0 | q4_0 | q4_1
    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: str = "auto"  # auto | native (C kernels on CPU, torch ops elsewhere; alias torch) | triton | flashinfer
    context_length: int | None = None  # cap below the model's own
    num_threads: int | None = None  # torch CPU threads; None: one per physical core (cores.py)
    disable_cuda_graph: bool = False
    pooling: str = "auto"  # embeddings: auto (the model folder's sentence-transformers pooling, else last) | last | mean | cls


@dataclass(frozen=True)
class CacheOptions:
    kv_memory_gb: float | None = None  # KV pool budget; None: 2 GB on CPU, most free memory on GPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; float16 for float32 on CPU | float16 | bfloat16 | float32 | int8 (CPU)
    gpu_memory_fraction: float = 0.85  # share of free GPU memory for the pool when on GPU
    disable_radix_cache: bool = False


@dataclass(frozen=True)
class SchedulerOptions:
    max_running_requests: int = 128
    chunked_prefill_size: int = 1024  # prefill tokens per step, over all requests
    schedule_policy: str = "dfs-weight"  # fcfs | lpm | dfs-weight (best in spruce bench prefix)
    prefill_first: bool = False  # True: a step with prefill work runs no decode tokens
    decode_reserve_ratio: float = 0.3  # share of future output tokens kept free at admission
    lpm_max_queue: int = 128  # lpm and dfs-weight fall back to fcfs beyond this queue length
    # greedy decode steps a batch of plain decodes runs in one call on the CPU (1: off)
    decode_steps: int = 8
    # a step's prefill is sized from the measured pace so the step stays under this, and
    # beside decodes gets half the time (scheduler/pace.py; 0: off, a whole chunk every step)
    max_step_ms: float = 250.0


@dataclass(frozen=True)
class ConstraintOptions:
    disable_jump_forward: bool = False
    jump_forward_min_chars: int = 2
    grammar_whitespace_pattern: str | None = None
    grammar_timeout_s: float = 30.0  # a grammar build past it is stopped (its worker killed)
    grammar_cache_size: int = 64  # compiled grammars kept, at most (entries)
    grammar_cache_mb: int = 1024  # compiled grammars kept, at most (estimated memory)
    grammar_memory_mb: int = 4096  # address-space cap of a grammar build worker process
    grammar_backend: str = (
        "auto"  # auto (per kind, docs/grammar-bench.md) | spruce | llguidance | outlines
    )

    def __post_init__(self) -> None:
        from spruce.constrained.backends import BACKEND_CHOICES

        if self.grammar_backend not in BACKEND_CHOICES:
            raise InvalidRequestError(
                f"grammar_backend must be one of {', '.join(BACKEND_CHOICES)}; got {self.grammar_backend!r}"
            )


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding (scheduler/speculative.py): `ngram` drafts from the request's own
    prompt and output (prompt lookup), `draft` from a draft model (engine/draft_model.py);
    drafts are verified with the next token in one forward pass."""

    speculative_algorithm: str = "none"  # none | ngram | draft (a draft model)
    speculative_draft_model_path: str | None = (
        None  # draft: a GGUF file or HF folder, the target's tokenizer
    )
    speculative_num_draft_tokens: int = 4  # drafted tokens a step, at most
    speculative_ngram_min_match_window_size: int = 2  # shortest suffix that may match
    speculative_ngram_max_match_window_size: int = 8  # longest suffix tried first
    speculative_max_batch_size: int = 16  # decoding requests above it: no drafts that step
    # one more row's cost as a share of a one-row step, for choosing draft lengths
    # (speculative.best_length); None: measured as steps run (step_costs.py)
    speculative_row_cost: float | None = None

    def __post_init__(self) -> None:
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise InvalidRequestError(
                f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; "
                f"got {self.speculative_algorithm!r}"
            )
        if (self.speculative_algorithm == "draft") != bool(self.speculative_draft_model_path):
            raise InvalidRequestError(
                "speculative_algorithm draft goes with speculative_draft_model_path (and only it)"
            )
        low = self.speculative_ngram_min_match_window_size
        if not 1 <= low <= self.speculative_ngram_max_match_window_size:
            raise InvalidRequestError("speculative ngram match windows: need 1 <= min <= max")
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise InvalidRequestError("speculative_num_draft_tokens must be in [1, 64]")


SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class ParallelOptions:
    tp_size: int = 1  # tensor parallelism (--tp): processes that each hold a slice of every layer
    nnodes: int = 1  # machines the tp ranks span (tp_size / nnodes ranks on each)
    node_rank: int = 0  # this machine's index; node 0 runs the scheduler (rank 0)
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous; None: a free local port
    dist_backend: str = "auto"  # auto: gloo on CPU, nccl on CUDA | gloo | nccl
    dist_timeout_s: float = 180.0  # every collective's deadline: a rank that cannot join, dies or hangs fails the others after this


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    constraint: ConstraintOptions = field(default_factory=ConstraintOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    seed: int = 0
    log_level: str | None = None  # None: leave the "spruce" logger as the application set it

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        groups = {name: {} for name in _SECTIONS}
        top = {}
        for key, value in options.items():
            section = _OWNER.get(key)
            if section is None and key not in _TOP_LEVEL:
                raise InvalidRequestError(
                    f"unknown option {key!r}; known: {', '.join(known_options())}"
                )
            (groups[section] if section else top)[key] = value
        parts = {name: cls_(**groups[name]) for name, cls_ in _SECTIONS.items()}
        return cls(**parts, **top)

    def to_dict(self) -> dict[str, Any]:
        out = {name: vars(getattr(self, name)) for name in _SECTIONS}
        return {**out, "seed": self.seed, "log_level": self.log_level}

    def to_options(self) -> dict[str, Any]:
        """The flat options `from_options` rebuilds this config from (tp ranks get them)."""
        flat = {k: v for name in _SECTIONS for k, v in vars(getattr(self, name)).items()}
        return {**flat, "seed": self.seed, "log_level": self.log_level}

    @property
    def resolved_device(self) -> str:
        if self.model.device != "auto":
            return self.model.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.model.dtype != "auto":
            return self.model.dtype
        return "float32" if self.resolved_device == "cpu" else "bfloat16"

    @property
    def num_threads(self) -> int:
        return self.model.num_threads or default_threads()


_SECTIONS = {
    "model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions,
    "constraint": ConstraintOptions, "speculative": SpeculativeOptions,
    "parallel": ParallelOptions,
}  # fmt: skip
_OWNER = {f.name: section for section, cls in _SECTIONS.items() for f in fields(cls)}
_TOP_LEVEL = {"seed", "log_level"}


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"  # HTTP and ZeroMQ bind address; 0.0.0.0 exposes the server
    port: int = 30000  # HTTP (native + OpenAI-compatible API)
    zmq_port: int = 30001  # ZeroMQ ROUTER socket for DSL clients
    api_key: str | None = (
        None  # required on every HTTP route but /health (Bearer) and in every ZeroMQ message; also from $SPRUCE_API_KEY
    )
    api_key_file: str | None = None  # a file holding the API key (keeps it off the command line)
    allowed_hosts: str | None = (
        None  # comma-separated Host header names (or *) besides the bound address and localhost
    )
    allow_unauthenticated_zmq: bool = (
        False  # let the ZeroMQ port listen beyond loopback without --api-key
    )
    allowed_origins: str | None = (
        None  # CORS: comma-separated origins (or *) browsers may call from; None: off
    )
    max_request_bytes: int = 16 * 2**20  # larger HTTP bodies / ZeroMQ frames get 413
    served_model_name: str | None = (
        None  # the name clients send as "model"; default: the model's file name
    )
    health_timeout_s: float = 5.0  # how long the throughput log waits for the scheduler's stats
    shutdown_timeout_s: float = (
        10.0  # on SIGTERM: time for in-flight requests before they are aborted
    )
    startup_timeout_s: float = 600.0  # how long the launcher waits for the model to load
    throughput_log_s: float = 5.0  # period of the throughput log line while busy (0: off)
    parent_pid: int | None = (
        None  # shut down when this process exits (for launchers like sl.Runtime)
    )
    chat_template: str | None = (
        None  # a Jinja file (or a tokenizer_config.json) replacing the model's chat template
    )
    reasoning_parser: str = "auto"  # chat: reasoning_content apart from content: auto (from the chat template) | none | qwen3 | deepseek-r1 | glm45 | minimax | kimi | kimi_k2 | mistral | gpt-oss (or a plugin's name)
    reasoning_parser_plugin: str | None = None  # module:Class of a ReasoningFormat subclass
    reasoning_budget: int = -1  # chat: default thinking budget, tokens (-1: none, 0: off)
    reasoning_budget_message: str | None = None  # written before the end marker at the budget
    tool_call_parser: str = "auto"  # chat: how the model writes tool calls: auto (from the chat template) | hermes | llama3_json | mistral | pythonic | json | qwen3_coder | glm45 | minimax_m2 | deepseek_v3 | deepseek_v31 | kimi_k2 | gpt-oss (or a plugin's name)
    tool_call_parser_plugin: str | None = (
        None  # module:Class of a ToolCallFormat subclass, registered under its name (docs/serving.md)
    )
    dp: int = (
        1  # data-parallel replicas: scheduler processes, each with its own KV pool and radix cache
    )
    router_policy: str = (
        "cache-aware"  # --dp: cache-aware (longest cached prefix unless unbalanced) | round-robin
    )
    router_cache_threshold: float = (
        0.5  # share of a prompt a replica must hold for the prefix to win
    )
    router_balance_abs_threshold: int = (
        32  # unbalanced (least-loaded wins) when busiest - idlest exceeds this ...
    )
    router_balance_rel_threshold: float = (
        1.5  # ... and busiest exceeds this times the idlest (requests in flight)
    )
    exit_on_replica_death: bool = (
        False  # exit when one replica dies (default: serve on the others; exit when none is left)
    )
    request_limits: RequestLimits = field(
        default_factory=RequestLimits
    )  # flags of their own (limits.py)
    serving_limits: ServingLimits = field(default_factory=ServingLimits)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["api_key"] = "<set>" if self.api_key else None
        out["request_limits"] = vars(self.request_limits)
        out["serving_limits"] = vars(self.serving_limits)
        return out

    @property
    def hosts(self) -> list[str]:
        return [h.strip().lower() for h in (self.allowed_hosts or "").split(",") if h.strip()]

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


def known_options() -> list[str]:
    return sorted(set(_OWNER) | _TOP_LEVEL)


def option_fields(*classes: type) -> list[tuple[str, type, Any]]:
    """(name, value type with Optional removed, default) of every field of the given config
    classes (default: every engine option), for building CLI flags."""
    out = []
    for cls in classes or (*_SECTIONS.values(), EngineConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in _SECTIONS:
                continue
            kind = hints[f.name]
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            out.append((f.name, args[0] if args else kind, f.default))
    return out


SPIN_COUNT = "3000"  # GOMP_SPINCOUNT: iterations an idle OpenMP thread spins before it sleeps


def use_omp_wait_policy() -> None:
    """Idle OpenMP threads spin briefly (GOMP_SPINCOUNT=3000, some tens of microseconds),
    then sleep. A decode step is a few hundred short parallel regions: sleeping at once
    (OMP_WAIT_POLICY=PASSIVE) pays a wake-up per region, spinning long holds a core that
    other work on the machine needs (docs/cpu.md has the A/B). A user's own OMP_WAIT_POLICY
    or GOMP_SPINCOUNT is kept. libgomp reads them once, when torch is first imported, so the
    entry points (the CLI, the Engine) call this before they import torch; importing a
    package never does."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


def wait_policy() -> str:
    """The OpenMP wait policy of this process, in words (the benchmarks print it)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").upper()
    spin = os.environ.get("GOMP_SPINCOUNT")
    if spin is not None:
        return f"spin {spin} iterations, then sleep (GOMP_SPINCOUNT={spin})"
    if policy in ("PASSIVE", "ACTIVE"):
        return f"OMP_WAIT_POLICY={policy} ({'sleep at once' if policy == 'PASSIVE' else 'always spin'})"
    return "libgomp's default (spin 300,000 iterations, then sleep)"
