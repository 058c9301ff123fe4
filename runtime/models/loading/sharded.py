"""Reading one tensor-parallel rank's slices of a checkpoint.

Hugging Face folders: each rank reads only its rows / columns of each weight, through
safetensors' memory-mapped slices (`get_slice(name)[rows]`), never the whole tensor.
GGUF files are read whole (dequantized: ranks hold float weights) and then sliced.
"""

from __future__ import annotations

import torch

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.parallel import pad_rows, take_slice, weight_slice


def read_safetensors_slices(
    files: list[str], config: ModelConfig, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every weight in `files` (`config`: the whole model's)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    out[name] = _read_slice(f, name, config, rank, world)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors for corrupt files
            raise ModelLoadError(f"cannot read {file}: {e}") from None
    return out


def _read_slice(f, name: str, config: ModelConfig, rank: int, world: int) -> torch.Tensor:
    part = weight_slice(name, config, rank, world)
    if part is None:
        return f.get_tensor(name)
    whole = f.get_slice(name)
    pieces = [whole[a:b] if part.dim == 0 else whole[:, a:b] for a, b in part.ranges]
    return pad_rows(torch.cat(pieces, dim=part.dim), part.rows)


def slice_state_dict(
    state_dict: dict, config: ModelConfig, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of an in-memory state dict (float tensors)."""
    out = {}
    for name, tensor in state_dict.items():
        part = weight_slice(name, config, rank, world)
        out[name] = tensor if part is None else take_slice(tensor, part)
    return out
