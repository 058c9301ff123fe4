"""Attention backends behind one interface, picked by name from a registry."""

from __future__ import annotations

import importlib

from spruce.runtime.attention.base import AttentionBackend, ForwardContext
from spruce.runtime.errors import SpruceError

# name -> "module:Class", imported on use so GPU-only packages are optional
ATTENTION_BACKENDS = {
    "torch": "spruce.runtime.attention.torch_backend:TorchAttentionBackend",
}


def create_backend(name: str, pool, req_to_token, num_heads: int, head_dim: int) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        known = ", ".join(sorted(ATTENTION_BACKENDS))
        raise SpruceError(f"unknown attention backend {name!r} (known: {known})")
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(pool, req_to_token, num_heads, head_dim)


__all__ = ["AttentionBackend", "ForwardContext", "ATTENTION_BACKENDS", "create_backend"]
