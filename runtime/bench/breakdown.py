"""`spruce bench offline --breakdown`: where a batch-1 decode step's time goes, from forward
hooks on the model's modules and wrappers around the attention backend, the sampler, the
runner and the step; and the decode step at full batch against the model's bare matmuls
(step_over_matmuls, which every `spruce bench offline` run prints)."""

from __future__ import annotations

import collections
import contextlib
import statistics
import time

import torch
from torch import nn


class StepTimers:
    """Wall time per part of each engine step, from forward hooks on the model's modules
    and wrappers around the attention backend, the sampler, the runner and the step
    (instance attributes, removed by close()). Per step: {part: seconds}."""

    def __init__(self, core) -> None:
        from spruce.runtime.models.layers import QuantizedEmbedding, QuantizedLinear, RMSNorm

        self.core, self.now, self.steps = core, collections.Counter(), []
        self.handles, self.wrapped = [], []
        model = core.runner.model
        for module in model.modules():
            if isinstance(module, (nn.Embedding, QuantizedEmbedding)):
                self._hook(module, "embedding")
            elif isinstance(module, (nn.Linear, QuantizedLinear)):
                self._hook(module, "matmuls")
            elif isinstance(module, RMSNorm):
                self._hook(module, "norms")
        self._hook(model, "model")
        if model.lm_head is None:  # the tied output projection is a method, not a module call
            self._wrap(model.embed_tokens, "as_linear", "matmuls")
        self._wrap(core.runner.backend, "forward", "attention")
        self._wrap(core.sampler, "sample", "sampling")
        self._wrap(core.runner, "forward", "runner")
        self._wrap(core, "step", "step", per_step=True)

    def _hook(self, module: nn.Module, part: str) -> None:
        started = []
        pre = module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        post = module.register_forward_hook(lambda *_: self._add(part, started.pop()))
        self.handles += [pre, post]

    def _add(self, part: str, start: float) -> None:
        self.now[part] += time.perf_counter() - start

    def _wrap(self, owner, name: str, part: str, per_step: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if per_step:
                self.now.clear()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._add(part, start)
                if per_step:
                    self.steps.append(dict(self.now))

        setattr(owner, name, timed)
        self.wrapped.append((owner, name))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        for owner, name in self.wrapped:
            delattr(owner, name)  # the class's own method shows through again


BREAKDOWN_ROWS = [  # (label, parts added, parts taken away)
    ("matmuls (linear layers + output head)", ["matmuls"], []),
    ("attention (KV write + attention)", ["attention"], []),
    ("residual add + RMSNorm", ["norms"], []),
    ("embedding lookup", ["embedding"], []),
    (
        "other model ops (rotary, SiLU*up, Python)",
        ["model"],
        ["matmuls", "attention", "norms", "embedding"],
    ),
    ("runner outside the model (batch tensors)", ["runner"], ["model"]),
    ("sampling", ["sampling"], []),
    ("scheduler + step bookkeeping", ["step"], ["runner", "sampling"]),
]


@contextlib.contextmanager
def one_step_a_call(engine):
    """No multi-step decode calls meanwhile (scheduler.decode_steps 1): each timed step is
    one forward pass through the modules and the sampler."""
    scheduler = engine.core.scheduler
    decode_steps, scheduler.decode_steps = scheduler.decode_steps, 1
    try:
        yield
    finally:
        scheduler.decode_steps = decode_steps


def step_breakdown(engine, prompt: list[int], params: dict) -> dict:
    """Mean ms per part of the batch-1 decode steps of one timed request, and the mean
    timed step (against an untimed run, the timers' own cost shows). The steps run one at
    a time (no multi-step decode calls), so each one's parts show."""
    timers = StepTimers(engine.core)
    try:
        with one_step_a_call(engine):
            engine.flush_cache()
            engine.generate(input_ids=prompt, sampling_params=params)
    finally:
        timers.close()
    decode = [st for st in timers.steps[2:] if "model" in st]  # past the prefill and the first step
    mean = {
        part: sum(st.get(part, 0.0) for st in decode) / len(decode) * 1e3 for part in timers.now
    }
    rows = {
        label: sum(mean.get(p, 0.0) for p in plus) - sum(mean.get(p, 0.0) for p in minus)
        for label, plus, minus in BREAKDOWN_ROWS
    }
    return {"steps": len(decode), "timed_step_ms": mean["step"], "parts_ms": rows}


def print_breakdown(b: dict) -> None:
    print(f"\nbatch-1 decode step, mean of {b['steps']} steps: {b['plain_step_ms']:.2f} ms "
          f"({b['timed_step_ms']:.2f} ms with the timers on)")  # fmt: skip
    # the timers are module hooks: with them the step takes the module path, not the decode
    # plan (models/decode_plan.py), so the parts describe the module path
    print("(timed through the modules: the C-only decode plan stands aside for hooks)")
    if "bare_matmul_ms" in b:  # the untimed step against its weights alone
        bare, plain = b["bare_matmul_ms"], b["plain_step_ms"]
        print(
            f"untimed step {plain:.2f} ms: linear layers alone (through their modules) {bare:.2f} ms ({bare / plain:.0%}), the rest {plain - bare:.2f} ms"
        )
    print("| part | ms per step | share |\n| --- | --- | --- |")
    for label, ms in b["parts_ms"].items():
        print(f"| {label} | {ms:.3f} | {ms / b['timed_step_ms']:.1%} |")


def bare_matmul_seconds(model, batch: int, repeats: int = 5) -> float:
    """Time of the model's linear layers alone for `batch` rows (the decode step's floor),
    through the same modules the model runs (quantized ones included)."""
    dtype = next(model.parameters()).dtype
    linears = []
    for layer in model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    head = model.embed_tokens.as_linear if model.lm_head is None else model.lm_head
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
    x = torch.randn(batch, model.config.hidden_size, dtype=dtype)

    def run():
        for m in linears:
            m(inputs[m.in_features])
        head(x)

    with torch.inference_mode():
        run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
    return (time.perf_counter() - start) / repeats


def step_over_matmuls(engine, prompts: list[list[int]], params: dict, every: int = 4) -> dict:
    """The decode step at the full batch against the bare matmuls for that batch, measured
    in pairs: every `every`-th all-decode step of the run is followed at once by one pass of
    the bare matmuls, so both see the same load on a shared machine (one measured apart,
    after the run, moved the ratio between 1.1x and 1.8x from run to run). Medians."""
    core, model, batch = engine.core, engine.core.loaded.model, len(prompts)
    engine.flush_cache()
    core.step_log, steps, bares, seen = [], [], [], 0
    stream = engine.generate(
        input_ids=prompts, sampling_params={**params, "ignore_eos": True}, stream=True
    )
    try:
        with one_step_a_call(engine):
            for _ in stream:
                if len(core.step_log) == seen:  # a chunk of a step already looked at
                    continue
                seen, last = len(core.step_log), core.step_log[-1]
                if last.all_decode and last.batch_size == batch and seen % every == 0:
                    steps.append(last.seconds)
                    bares.append(bare_matmul_seconds(model, batch, repeats=1))
    finally:
        core.step_log = None
    if not steps:
        return {}
    step, bare = statistics.median(steps) * 1e3, statistics.median(bares) * 1e3
    return {"paired_step_ms": step, "bare_matmul_ms": bare, "decode_step_over_matmul": step / bare,
            "pairs": len(steps), "paired_batch": batch}  # fmt: skip
