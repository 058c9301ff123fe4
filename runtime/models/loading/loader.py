"""Loads a model + tokenizer from a Hugging Face folder or a GGUF file (no path: the
bundled default model, see model_files.py)."""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spruce.runtime.errors import ModelLoadError
from spruce.runtime.executor.distributed import TPGroup
from spruce.runtime.executor.kernels import cpu_quant_ops
from spruce.runtime.models import model_class
from spruce.runtime.models.config import ModelConfig
from spruce.runtime.models.loading.files import checkpoint_kind, default_model_path
from spruce.runtime.models.loading.quantize import QuantizedTensor, check_quantization, quantize
from spruce.runtime.models.loading.sharded import read_safetensors_slices, slice_state_dict
from spruce.runtime.models.parallel import parallelize, shard_config
from spruce.runtime.models.weights import spruce_names
from spruce.runtime.text.tokenizer import Tokenizer

logger = logging.getLogger("spruce")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: str
    name: str


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r} (supported: {', '.join(DTYPES)})") from None


def load_model(
    path: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    quantization: str = "auto",
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Loads weights and tokenizer; logs architecture, size in memory, dtype, quantization
    and seconds. `quantization` (see loading/quantize.py) applies on the CPU only: `auto`
    means `none` elsewhere, and an explicit format elsewhere is an error. With `tp`, this
    rank's slices only (models/parallel.py), in float: the config is the rank's."""
    start = time.perf_counter()
    path = path or default_model_path()
    dtype = parse_dtype(dtype)
    quantization = _effective_quantization(check_quantization(quantization), device, tp)
    hf_config, state_dict, tokenizer = read_checkpoint(path, dtype, quantization != "none", tp)
    config = ModelConfig.from_hf(hf_config)
    if tp is not None:
        config = shard_config(config, tp.world)
    model = _build(config, state_dict, dtype, torch.device(device), quantization, tp)
    name = os.path.basename(os.path.normpath(path))
    logger.info(
        "loaded %s (%s, %.0f MB in memory, %s, quantization %s) in %.2f s",
        name, config.architecture, model_bytes(model) / 1e6, str(dtype).removeprefix("torch."),
        quantization, time.perf_counter() - start,
    )  # fmt: skip
    return LoadedModel(model, config, tokenizer, path, name)


def model_bytes(model: nn.Module) -> int:
    """The bytes of a model's parameters and buffers (quantized blocks included)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _effective_quantization(quantization: str, device: str, tp: TPGroup | None = None) -> str:
    if tp is not None and quantization not in ("auto", "none"):
        raise ModelLoadError(
            f"--quantization {quantization} does not combine with --tp {tp.world}: tensor-parallel "
            "ranks hold float weights (use --quantization none)"
        )
    if tp is not None:
        return "none"
    if quantization == "none" or (torch.device(device).type == "cpu" and cpu_quant_ops.available()):
        return quantization
    if quantization == "auto":
        return "none"
    raise ModelLoadError(
        f"--quantization {quantization} runs on the CPU with the C kernels only "
        f"(device {device}{'' if cpu_quant_ops.available() else ', no C compiler'}); use --quantization none"
    )


def read_checkpoint(
    path: str, dtype: torch.dtype, keep_quantized: bool = False, tp: TPGroup | None = None
) -> tuple[dict, dict[str, Any], Tokenizer]:
    """(Hugging Face config dict, state dict in HF names, tokenizer) of a folder or GGUF
    file; with `keep_quantized`, a GGUF file's quantized weights stay quantized; with `tp`,
    this rank's slices (a folder's read as slices; a GGUF file's read whole, then sliced)."""
    if checkpoint_kind(path) == "folder":
        return _read_hf_folder(path, tp)
    hf_config, state_dict, tokenizer = _read_gguf(path, dtype, keep_quantized)
    if tp is not None:
        config = ModelConfig.from_hf(hf_config)
        shard_config(config, tp.world)  # heads that do not split: one line, before slicing
        state_dict = slice_state_dict(state_dict, config, tp.rank, tp.world)
    return hf_config, state_dict, tokenizer


def _read_hf_folder(folder: str, tp: TPGroup | None = None):
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(
            f"{folder} has no config.json; a model folder needs config.json, *.safetensors and tokenizer.json"
        )
    with open(config_path, encoding="utf-8") as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf(hf_config)
    model_class(config)  # an unknown model (or one --tp cannot split) fails before the weights
    if tp is not None:
        shard_config(config, tp.world)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights (PyTorch .bin files are not loaded)"
        )
    if tp is not None:
        state_dict = read_safetensors_slices(files, config, tp.rank, tp.world)
    else:
        state_dict = _read_safetensors(files)
    return hf_config, state_dict, Tokenizer.from_folder(folder, hf_config)


def _read_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for file in files:  # sharded checkpoints: every shard's tensors into one dict
        try:
            state_dict.update(load_file(file))
        except Exception as e:  # noqa: BLE001 - safetensors' own errors for corrupt files
            raise ModelLoadError(f"cannot read {file}: {e}") from None
    return state_dict


def _read_gguf(path: str, dtype: torch.dtype, keep_quantized: bool):
    from spruce.runtime.models.loading.gguf import read_gguf
    from spruce.runtime.models.loading.gguf_convert import gguf_to_hf

    gguf_file = read_gguf(path)
    hf_config, state_dict = gguf_to_hf(gguf_file, dtype, keep_quantized)
    return hf_config, state_dict, Tokenizer.from_gguf_metadata(gguf_file.metadata)


def _build(
    config: ModelConfig,
    state_dict: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    tp: TPGroup | None = None,
) -> nn.Module:
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
        if tp is not None:
            parallelize(model, tp)
    try:
        if quantization != "none":
            state_dict = spruce_names(state_dict)
            model.use_quantized_weights(_quantized_weights(model, state_dict, quantization), dtype)
        model = model.to_empty(device=device).to(dtype)
        model.build_rotary(device)  # the rotary tables are computed, not loaded
        model.load_hf_weights(state_dict)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"weights do not fit {config.architecture}: {e}") from None
    return model.eval().requires_grad_(False)


def _quantized_weights(
    model: nn.Module, state_dict: dict[str, Any], quantization: str
) -> dict[str, QuantizedTensor]:
    """The linear and embedding weights to keep quantized, in `quantization` (`auto`: as
    they come); state_dict is updated to hold them."""
    out = {}
    for name, module in model.named_modules():
        weight = state_dict.get(f"{name}.weight")
        if (
            not isinstance(module, (nn.Linear, nn.Embedding))
            or weight is None
            or weight.shape[-1] % 32
        ):
            continue
        if quantization != "auto" and getattr(weight, "qtype", None) != quantization:
            floats = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            weight = quantize(floats, quantization)
        if isinstance(weight, QuantizedTensor):
            out[f"{name}.weight"] = state_dict[f"{name}.weight"] = weight
    return out
