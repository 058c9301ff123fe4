"""spruce.runtime: the serving runtime (models, KV pool, scheduler, Engine, server)."""

from __future__ import annotations

from spruce.runtime.errors import ConstraintError, InvalidRequestError, ModelLoadError, SpruceError
from spruce.runtime.sampling_params import SamplingParams


def __getattr__(name: str):
    # The Engine pulls in torch and the model code; import it on first use only.
    if name == "Engine":
        from spruce.runtime.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "SamplingParams", "SpruceError", "InvalidRequestError", "ModelLoadError", "ConstraintError"]
