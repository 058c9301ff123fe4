"""Backend selection, and the triton backend equal to the native one inside the model
(on the CPU under TRITON_INTERPRET=1, set by conftest)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.attention import resolve_backend
from spruce.runtime.executor.model_runner import ForwardItem, ModelRunner
from spruce.runtime.models.loading.loader import load_model

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def test_auto_picks_native_on_cpu():
    assert resolve_backend("auto", "cpu") == "native"


def test_torch_is_an_alias_of_native():
    assert resolve_backend("torch", "cpu") == "native"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_picks_a_gpu_backend():
    assert resolve_backend("auto", "cuda") == ("flashinfer" if HAS_FLASHINFER else "triton")


def test_unknown_backend_lists_known_ones():
    with pytest.raises(
        SpruceError,
        match="unknown attention backend 'flash'.*auto, flashinfer, native, triton, torch",
    ):
        resolve_backend("flash", "cpu")


def test_forced_gpu_backend_on_cpu_is_a_clear_error(monkeypatch):
    with pytest.raises(SpruceError, match="flashinfer"):
        resolve_backend("flashinfer", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if HAS_TRITON:
        with pytest.raises(SpruceError, match="'triton' needs a CUDA GPU"):
            resolve_backend("triton", "cpu")


def run_mixed_batch(loaded, backend: str) -> list[torch.Tensor]:
    """Prefill two prompts (one in two chunks), then a mixed step: decode + extend."""
    device = str(next(loaded.model.parameters()).device)
    runner = ModelRunner(
        loaded, num_slots=512, max_requests=4, max_context_len=128,
        attention_backend=backend, device=device,
    )  # fmt: skip
    rows = [runner.req_to_token.alloc_row() for _ in range(3)]
    a, b, c = list(range(5, 30)), list(range(40, 52)), list(range(60, 80))

    def item(row, prefix, ids, all_logits=True):
        return ForwardItem(row, prefix, ids, runner.pool.alloc(len(ids)), all_logits)

    out = [runner.forward([item(rows[0], 0, a), item(rows[1], 0, b[:7])]).logits]
    out.append(
        runner.forward(
            [item(rows[1], 7, b[7:]), item(rows[0], 25, [3]), item(rows[2], 0, c)]
        ).logits
    )
    out.append(
        runner.forward(
            [item(rows[0], 26, [4]), item(rows[1], 12, [9]), item(rows[2], 20, [11])]
        ).logits
    )
    return out


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="CPU interpreter test")
def test_triton_backend_equals_native_in_the_model(tiny_llama_dir):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    loaded = load_model(str(tiny_llama_dir))
    for got, want in zip(run_mixed_batch(loaded, "triton"), run_mixed_batch(loaded, "native")):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backends_equal_native(tiny_llama_dir, backend):
    if backend == "flashinfer" and not HAS_FLASHINFER:
        pytest.skip("flashinfer not installed")
    loaded = load_model(str(tiny_llama_dir), dtype="bfloat16", device="cuda")
    for got, want in zip(run_mixed_batch(loaded, backend), run_mixed_batch(loaded, "native")):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def decode_steps(loaded, cuda_graph: bool, steps: int = 4) -> list[torch.Tensor]:
    """Logits of decode steps for 3 requests (a captured size of 4: one padding row), after
    the memory freed at capture has been handed out again and overwritten."""
    runner = ModelRunner(
        loaded, num_slots=512, max_requests=8, max_context_len=128,
        attention_backend="triton", device="cuda", cuda_graph=cuda_graph,
    )  # fmt: skip
    held = [torch.full((n,), 10**6, dtype=torch.int64, device="cuda") for n in range(1, 2000)]
    rows = [runner.req_to_token.alloc_row() for _ in range(3)]
    prompts = [list(range(5, 30)), list(range(40, 52)), list(range(60, 80))]
    items = [ForwardItem(r, 0, p, runner.pool.alloc(len(p))) for r, p in zip(rows, prompts)]
    runner.forward(items)
    lens, out = [len(p) for p in prompts], []
    for step in range(steps):
        items = [
            ForwardItem(r, lens[i], [7 * step + i + 3], runner.pool.alloc(1))
            for i, r in enumerate(rows)
        ]
        out.append(runner.forward(items).logits)
        lens = [n + 1 for n in lens]
    del held
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replays_equal_eager_steps(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), dtype="bfloat16", device="cuda")
    for got, want in zip(decode_steps(loaded, True), decode_steps(loaded, False)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_auto_skips_flashinfer_for_models_it_cannot_attend(monkeypatch):
    import spruce.runtime.executor.attention as attention

    monkeypatch.setattr(attention, "_importable", lambda module: True)
    assert resolve_backend("auto", "cuda", attention.AttentionOptions(scale=0.2)) == "flashinfer"
    assert (
        resolve_backend("auto", "cuda", attention.AttentionOptions(layer_windows=(8, None)))
        == "triton"
    )
    assert (
        resolve_backend("auto", "cuda", attention.AttentionOptions(logit_softcap=50.0)) == "triton"
    )


def test_flashinfer_refuses_sliding_windows_in_one_line():
    from spruce.runtime.executor.attention import AttentionOptions
    from spruce.runtime.executor.attention.flashinfer_backend import refuse_unsupported

    refuse_unsupported(AttentionOptions(scale=0.1))
    with pytest.raises(
        SpruceError, match="'flashinfer' does not implement sliding-window attention"
    ):
        refuse_unsupported(AttentionOptions(layer_windows=(4096, None)))


def test_int8_cache_without_the_c_kernel_equals_with_it(tiny_llama_dir):
    """The torch path (no C compiler) reads an int8 pool through its scales as the C kernel
    does: a prefill, then decode steps over the cached tokens, same logits to rounding."""
    loaded = load_model(str(tiny_llama_dir))
    results = []
    for use_kernel in (True, False):
        runner = ModelRunner(loaded, 64, 2, 32, kv_dtype=torch.int8)
        if use_kernel and runner.backend.cpu_kernel is None:
            pytest.skip("no C compiler here")
        if not use_kernel:
            runner.backend.cpu_kernel = None
        row = runner.req_to_token.alloc_row()
        logits = [runner.forward([ForwardItem(row, 0, [5, 9, 2, 7], runner.pool.alloc(4))]).logits]
        for step in range(6):
            logits.append(
                runner.forward(
                    [ForwardItem(row, 4 + step, [11 + step], runner.pool.alloc(1))]
                ).logits
            )
        results.append(torch.cat(logits))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)
