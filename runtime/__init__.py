"""spruce.runtime: the serving runtime (models, KV pool, scheduler, Engine, server)."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning. On small shared machines a spinning torch
# thread holds a core another process (or the other torch thread) needs: measured here, a
# batch-64 decode step took 8.4 s with spinning vs 0.37 s with this, under load. libgomp
# reads the variable once, when torch is first imported, so this must run before that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from spruce.runtime.errors import ConstraintError, InvalidRequestError, ModelLoadError, SpruceError
from spruce.runtime.sampling_params import SamplingParams


def __getattr__(name: str):
    # The Engine pulls in torch and the model code; import it on first use only.
    if name == "Engine":
        from spruce.runtime.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams", "SpruceError", "InvalidRequestError", "ModelLoadError", "ConstraintError"]
