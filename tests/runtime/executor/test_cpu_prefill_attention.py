"""The C prefill-attention kernel (causal attention of a prompt's new tokens, after a cached
prefix, with GQA and sliding windows) equals scaled_dot_product_attention in float64 with
an explicit mask, on every float-kernel variant this CPU runs; and the native backend
gives the same model outputs with it and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spruce.runtime.executor.attention import native_backend
from spruce.runtime.executor.kernels import cpu_library
from spruce.runtime.executor.kernels.cpu_attention import prefill_attention

pytestmark = pytest.mark.skipif(cpu_library.c_compiler() is None, reason="no C compiler")


def reference(q, k, v, prefix: int, scale: float, window: int | None = None) -> torch.Tensor:
    length, total = q.shape[0], k.shape[0]
    q_pos = torch.arange(length)[:, None] + prefix
    key_pos = torch.arange(total)[None, :]
    mask = key_pos <= q_pos
    if window is not None:
        mask &= key_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None].double() for t in (q, k, v)), attn_mask=mask[None, None], scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).float()


# (length, prefix, heads, kv_heads, dim, window): lengths around the 32-key block and the
# 16-position task, a cached prefix, GQA groups 1-4, head_dim 16-128 (80 and 48: not a
# multiple of the 64-float value pass), windows inside a block, across blocks, longer than all
CASES = [
    (1, 0, 4, 4, 64, None), (15, 0, 9, 3, 64, None), (16, 0, 9, 3, 64, None), (17, 0, 8, 2, 128, None),
    (100, 0, 9, 3, 64, None), (37, 50, 4, 1, 32, None), (1, 10, 3, 3, 48, None), (70, 0, 4, 2, 80, 17),
    (300, 20, 6, 3, 64, 64), (40, 0, 2, 2, 16, 5), (33, 7, 8, 4, 64, 1000), (32, 0, 9, 3, 64, 31),
]  # fmt: skip


@pytest.mark.parametrize("length,prefix,heads,kv_heads,dim,window", CASES)
def test_matches_reference(cpu_isa, length, prefix, heads, kv_heads, dim, window):
    g = torch.Generator().manual_seed(length * 31 + prefix + dim)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, : heads * dim].view(length, heads, dim)  # rows strided, as the projection gives them
    k = torch.randn(prefix + length, kv_heads, dim, generator=g)
    v = torch.randn(prefix + length, kv_heads, dim, generator=g)
    got = prefill_attention(q, k, v, prefix, dim**-0.5, window)
    torch.testing.assert_close(
        got, reference(q, k, v, prefix, dim**-0.5, window), atol=1e-5, rtol=1e-5
    )


def test_rising_scores_rescale_exactly(cpu_isa):
    """Scores that climb key block after key block move each row's running max many times.
    (Scores reach ~100 here, unscaled: their float32 rounding, ~1e-5, is the tolerance.)"""
    g = torch.Generator().manual_seed(3)
    length = 400
    growth = torch.linspace(0.0, 6.0, length).view(length, 1, 1)
    q = torch.randn(length, 9, 64, generator=g)
    k = torch.randn(length, 3, 64, generator=g) * (1 + growth)
    v = torch.randn(length, 3, 64, generator=g)
    torch.testing.assert_close(
        prefill_attention(q, k, v, 0, 1.0), reference(q, k, v, 0, 1.0), atol=1e-4, rtol=1e-4
    )


def test_same_result_on_any_thread_count(cpu_isa):
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(90, 9, 64, generator=g),
        torch.randn(90, 3, 64, generator=g),
        torch.randn(90, 3, 64, generator=g),
    )
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(prefill_attention(q, k, v, 0, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_head_dim_off_the_vector_width_is_declined():
    q, k = torch.randn(4, 2, 24), torch.randn(4, 2, 24)
    assert prefill_attention(q, k, k, 0, 0.2) is None


def test_model_outputs_equal_with_and_without_the_kernel(tiny_llama_dir, monkeypatch):
    """The engine's prefill (a fresh prompt, then one sharing its prefix with the cache) gives
    the same greedy tokens and near-identical logprobs with the kernel and through SDPA."""
    from spruce.runtime.engine.offline import Engine

    prompts = [list(range(5, 60)), list(range(5, 40)) + list(range(70, 90))]
    params = {"max_new_tokens": 6, "temperature": 0}
    results = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(native_backend, "prefill_attention", lambda *args: None)
        engine = Engine(model_path=str(tiny_llama_dir))
        try:
            results.append(
                [
                    engine.generate(
                        input_ids=p,
                        sampling_params=params,
                        return_logprob=True,
                        logprob_start_len=0,
                    )
                    for p in prompts
                ]
            )
        finally:
            engine.shutdown()
    for with_kernel, without in zip(*results):
        assert with_kernel["output_ids"] == without["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            ours, theirs = with_kernel["meta_info"][key], without["meta_info"][key]
            assert len(ours) == len(theirs) > 0
            for a, b in zip(ours, theirs):
                assert a[1] == b[1] and (a[0] is None or abs(a[0] - b[0]) < 1e-4), (key, a, b)
