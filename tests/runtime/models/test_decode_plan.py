"""The C-only decode path (models/decode_plan.py) gives the module path's logits exactly,
at batch 1 and for several requests (integer kernel or GEMM), with and without a q/k/v
bias; it stands aside for hooked modules and extend batches."""

from __future__ import annotations

import ctypes

import pytest
import torch

from spruce.runtime.executor.kernels import cpu_library, cpu_quant_ops
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models import decode_plan
from spruce.runtime.models.layers import PLAIN_KINDS
from spruce.runtime.models.loading.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_quant_ops.available(), reason="no C compiler")


def decode(loaded, prompts: list[list[int]], steps: int, kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits of `steps` decode steps after prefilling `prompts` (fixed next tokens, so any
    two runs feed the same ones)."""
    runner = ModelRunner(loaded, 256 + 12 * len(prompts), len(prompts) + 1, 64, kv_dtype=kv_dtype)
    rows = [runner.req_to_token.alloc_row() for _ in prompts]
    items = [ForwardItem(r, 0, p, runner.pool.alloc(len(p))) for r, p in zip(rows, prompts)]
    runner.forward(items)
    lens, out = [len(p) for p in prompts], []
    for step in range(steps):
        items = [
            ForwardItem(r, lens[i], [(7 * step + 13 * i + 5) % 300], runner.pool.alloc(1))
            for i, r in enumerate(rows)
        ]
        out.append(runner.forward(items).logits)
        lens = [n + 1 for n in lens]
    return torch.cat(out)


# more requests than the integer GEMV takes: the plan's linear layers are a GEMM's
MANY = max(cpu_quant_ops.INTEGER_MAX_ROWS.values()) + 2


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # Qwen2: q/k/v bias
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize(
    "requests,kv_dtype",
    [(1, torch.float16), (3, torch.float32), (MANY, torch.float32), (MANY, torch.int8)],
)
def test_plan_equals_module_path(request, monkeypatch, fixture, qtype, requests, kv_dtype):
    loaded = load_model(str(request.getfixturevalue(fixture)), quantization=qtype)
    prompts = [[3 + i, 40 + i, 77, 12 + 5 * i][: 2 + i] for i in range(requests)]
    runs = []  # per planned step: whether the head ran in C too
    real_step = decode_plan.DecodePlan._step
    monkeypatch.setattr(
        decode_plan.DecodePlan, "_step", lambda *a: runs.append(a[-1] is not None) or real_step(*a)
    )
    planned = decode(loaded, prompts, 6, kv_dtype)
    assert runs == [True] * 6  # every decode step with its head, never the prefill
    hook = loaded.model.layers[0].mlp.register_forward_hook(
        lambda *_: None
    )  # the plan stands aside
    try:
        plain = decode(loaded, prompts, 6, kv_dtype)
    finally:
        hook.remove()
    assert len(runs) == 6
    assert torch.equal(planned, plain)


def test_plan_needs_quantized_linear_layers(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), quantization="none")
    assert decode_plan.build(loaded.model, PLAIN_KINDS) is None


def test_plan_follows_replaced_weights(tiny_llama_dir):
    """A parameter's storage swapped in place, or a buffer replaced, rebuilds the plan."""
    loaded = load_model(str(tiny_llama_dir), quantization="q8_0")
    prompts = [[3, 40, 77]]
    decode(loaded, prompts, 2, torch.float32)
    first = loaded.model.__dict__["_plan"]
    norm = loaded.model.layers[0].input_layernorm
    norm.weight.data = norm.weight.data * 2
    mlp = loaded.model.layers[1].mlp
    mlp.down_proj.blocks = mlp.down_proj.blocks.clone()
    planned = decode(loaded, prompts, 3, torch.float32)
    assert loaded.model.__dict__["_plan"] is not first
    hook = loaded.model.layers[0].register_forward_hook(lambda *_: None)
    try:
        assert torch.equal(planned, decode(loaded, prompts, 3, torch.float32))
    finally:
        hook.remove()


def test_head_follows_replaced_weights(tiny_llama_dir):
    """The final norm's weight or the output projection replaced rebuilds the plan, whose
    logits again equal the module path's."""
    loaded = load_model(str(tiny_llama_dir), quantization="q4_1")
    model, prompts = loaded.model, [[3, 40, 77]]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    decode(loaded, prompts, 2, torch.float32)
    for replace in (
        lambda: setattr(model.norm.weight, "data", model.norm.weight.data * 3),
        lambda: setattr(head, "blocks", head.blocks.flip(0).clone()),
    ):
        first = model.__dict__["_plan"]
        replace()
        planned = decode(loaded, prompts, 3, torch.float32)
        assert model.__dict__["_plan"] is not first and model.__dict__["_plan"].head is not None
        hook = model.layers[0].register_forward_hook(lambda *_: None)
        try:
            assert torch.equal(planned, decode(loaded, prompts, 3, torch.float32))
        finally:
            hook.remove()


def test_head_in_c_only_for_the_plain_norm_and_a_quantized_head_without_bias(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), quantization="q8_0").model
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert decode_plan._head(model, PLAIN_KINDS) == (model.norm, head)
    head.bias = torch.zeros(head.out_features)
    assert decode_plan._head(model, PLAIN_KINDS) is None
    head.bias = None
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    assert decode_plan._head(model, PLAIN_KINDS) is None
    assert decode_plan.build(model, PLAIN_KINDS).head is None  # the layers still planned


def test_kernel_table_follows_each_weight_type():
    """The C loop's table by ggml type id holds cpu_quant_ops.kernel's choice per format."""
    plan = decode_plan.DecodePlan.__new__(decode_plan.DecodePlan)
    plan.qtypes, plan.kernel_codes = {"q4_1", "q4_k"}, {}
    q4_1, q4_k = (cpu_quant_ops.QUANT_TYPES[name].ggml_id for name in ("q4_1", "q4_k"))
    for rows in (1, cpu_quant_ops.K_INTEGER_MAX_ROWS + 1, 64):
        isa = cpu_quant_ops.best_isa()
        codes = plan._kernel_codes(rows, isa)
        for name, kind in (("q4_1", q4_1), ("q4_k", q4_k)):
            assert codes[kind] == decode_plan.KERNEL_CODES[cpu_quant_ops.kernel(name, rows)]
        assert plan._kernel_codes(rows, isa) is codes  # built once per row count


def test_step_structs_checked_against_the_c_layout(monkeypatch):
    """The ctypes mirrors of the C step structs are checked field by field at load: a field
    that one side lacks makes the plan refuse to run."""
    lib = cpu_library.load_library()
    decode_plan.check_layout(lib)  # as they are: equal

    class Short(ctypes.Structure):
        _fields_ = decode_plan.StepArgs._fields_[:-1]

    monkeypatch.setattr(decode_plan, "StepArgs", Short)
    with pytest.raises(RuntimeError, match="step structs"):
        decode_plan.check_layout(lib)
