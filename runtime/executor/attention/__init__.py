"""Attention backends behind one interface, picked by name from a registry."""

from __future__ import annotations

import importlib
import importlib.util
import os

from spruce.runtime.errors import SpruceError
from spruce.runtime.executor.attention.base import (
    AttentionBackend,
    AttentionOptions,
    ForwardContext,
)

# name -> "module:Class", imported on use so GPU-only packages are optional
ATTENTION_BACKENDS = {
    "native": "spruce.runtime.executor.attention.native_backend:NativeAttentionBackend",
    "triton": "spruce.runtime.executor.attention.triton_backend:TritonAttentionBackend",
    "flashinfer": "spruce.runtime.executor.attention.flashinfer_backend:FlashInferAttentionBackend",
}
ALIASES = {"torch": "native"}  # the native backend's name before it had C kernels
_NEEDS = {"triton": "triton", "flashinfer": "flashinfer"}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend(name: str, device: str, options: AttentionOptions | None = None) -> str:
    """`auto`: flashinfer if importable on a GPU (and the model's `options` need nothing it
    lacks: sliding windows, soft-capping), else triton on a GPU, native on a CPU. A forced
    backend that cannot run here is a clear error."""
    on_gpu = device.startswith("cuda")
    name = ALIASES.get(name, name)
    if name == "auto":
        plain = options is None or options == AttentionOptions(scale=options.scale)
        if on_gpu and _importable("flashinfer") and plain:
            return "flashinfer"
        return "triton" if on_gpu and _importable("triton") else "native"
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(["auto", *sorted(ATTENTION_BACKENDS), *sorted(ALIASES)])
        raise SpruceError(f"unknown attention backend {name!r} (known: {known})")
    needs = _NEEDS.get(name)
    if needs and not _importable(needs):
        raise SpruceError(
            f"attention backend {name!r} needs the {needs} package: pip install 'spruce[gpu]'"
        )
    if name == "flashinfer" and not on_gpu:
        raise SpruceError(
            "attention backend 'flashinfer' needs a CUDA GPU; use --attention-backend native"
        )
    if name == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SpruceError(
            "attention backend 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1 for testing)"
        )
    return name


def create_backend(
    name: str,
    pool,
    req_to_token,
    num_heads: int,
    head_dim: int,
    options: AttentionOptions | None = None,
) -> AttentionBackend:
    """The backend `name` (or its alias) for this pool; a backend that cannot implement
    `options` (sliding windows, soft-capping) refuses with SpruceError."""
    name = ALIASES.get(name, name)
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise SpruceError(f"unknown attention backend {name!r} (known: {known})")
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(pool, req_to_token, num_heads, head_dim, options)


__all__ = [
    "AttentionBackend", "AttentionOptions", "ForwardContext", "ATTENTION_BACKENDS", "ALIASES",
    "create_backend", "resolve_backend",
]  # fmt: skip
