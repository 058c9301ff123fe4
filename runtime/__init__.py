"""spruce.runtime: the serving runtime (models, KV pool, scheduler, Engine, server).

Importing it has no side effects: the Engine (torch and the model code) loads on first use,
and the environment is left alone (see `config.use_omp_wait_policy`)."""

from __future__ import annotations

from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.errors import ConstraintError, InvalidRequestError, ModelLoadError, SpruceError


def __getattr__(name: str):
    # The Engine pulls in torch and the model code; import it on first use only.
    if name == "Engine":
        from spruce.runtime.engine.offline import Engine

        return Engine
    raise AttributeError(name)


__all__ = [
    "Engine",
    "SamplingParams",
    "SpruceError",
    "InvalidRequestError",
    "ModelLoadError",
    "ConstraintError",
]
