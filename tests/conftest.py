"""Shared fixtures for every test folder (tests/ mirrors the packages); the helpers they use
are in tests/support.py. No downloads, no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Idle threads sleep at once in tests: several processes (servers, the tests) share a few
# cores, where spinning threads slow each other. Set before torch is imported; the servers
# the tests start inherit it (a user's OMP_WAIT_POLICY is kept: config.use_omp_wait_policy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

# Triton kernels run in its interpreter when there is no GPU; the variable must be set
# before triton is first imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import write_tiny_model

from spruce.runtime.executor.kernels import cpu_library


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from spruce.runtime.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(str(tiny_llama_dir))


@pytest.fixture(params=list(cpu_library.ISA_FLAGS))
def cpu_isa(request) -> str:
    """Each variant of the C kernels (portable, avx2, avx512 on x86) bound in turn: the float
    kernels and the quantized kernels' default (cpu_library.use_isa), so an AVX-512 machine
    checks what an AVX2 one runs and the reverse. A variant this CPU lacks is a skip that says
    so; no C compiler is a skip, a failed build a failure."""
    if cpu_library.c_compiler() is None:
        pytest.skip("no C compiler here")
    assert cpu_library.load_library() is not None, (
        "the C kernels failed to build (see the logged error)"
    )
    if request.param not in cpu_library.available_isas():
        pytest.skip(
            f"this CPU lacks the {request.param} variant (runs {cpu_library.available_isas()})"
        )
    previous = cpu_library.use_isa(request.param)
    yield request.param
    cpu_library.use_isa(previous)
