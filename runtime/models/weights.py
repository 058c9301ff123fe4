"""Hugging Face parameter names -> the decoder's own, strictly.

The decoder fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and stores a
layer's experts stacked (`experts.gate_up_proj` [E, 2 * I, H], `experts.down_proj` [E, H, I],
transformers >= 5's layout). Checkpoints may hold either form: separate projections
(Llama), fused ones (Phi-3), experts one by one (`experts.{e}.gate_proj`, Qwen3-MoE on the
Hub; `block_sparse_moe.experts.{e}.w1`, Mixtral) or stacked. Multimodal checkpoints (Gemma 3
4B and up) keep the text model under `language_model.`; their image weights are skipped.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from spruce.runtime.models.loading.quantize import QuantizedTensor, quantize

_RENAMES = [
    (re.compile(r"^(language_model\.model|model\.language_model|model|language_model)\."), ""),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
]
_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def load_hf_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor | QuantizedTensor]
) -> None:
    """Copies every parameter of `model` from `state_dict`; raises KeyError for missing or
    unexpected weights and ValueError for a shape that does not fit.

    A quantized weight (`QuantizedTensor`) goes as it is into a module that keeps its
    weights quantized (one with `load_quantized`, named `<module>.weight`), and is
    dequantized for a plain parameter."""
    params: dict[str, nn.Parameter | nn.Module] = dict(model.named_parameters())
    params |= {f"{n}.weight": m for n, m in model.named_modules() if hasattr(m, "load_quantized")}
    loaded = set()
    for name, tensor in spruce_names(state_dict).items():
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied checkpoints sometimes still store it
        if name not in params:
            raise KeyError(f"unexpected weight {name!r}")
        target = params[name]
        if isinstance(target, nn.Module):
            target.load_quantized(tensor)
            loaded.add(name)
            continue
        if isinstance(tensor, QuantizedTensor):
            tensor = tensor.dequantize()
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise KeyError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


# The image side of multimodal checkpoints whose text model is served alone.
_IMAGE_PARTS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def spruce_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        _rename(name): tensor for name, tensor in state_dict.items() if not _IMAGE_PARTS.match(name)
    }
    _fuse(out, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
    _fuse(out, ("gate_proj", "up_proj"), "gate_up_proj")
    _stack_experts(out)
    return out


def _rename(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def _fuse(sd: dict[str, torch.Tensor], parts: tuple[str, ...], fused: str) -> None:
    """Concatenates `<prefix>.<part>.<kind>` rows into `<prefix>.<fused>.<kind>` (not experts')."""
    first = re.compile(rf"(layers\.\d+\..*)\.{parts[0]}\.(weight|bias)")
    for name in [n for n in sd if first.fullmatch(n) and ".experts." not in n]:
        prefix, kind = first.fullmatch(name).groups()
        names = [f"{prefix}.{p}.{kind}" for p in parts]
        if all(n in sd for n in names):
            sd[f"{prefix}.{fused}.{kind}"] = concat_rows([sd.pop(n) for n in names])


def concat_rows(tensors: list) -> torch.Tensor | QuantizedTensor:
    """Row concatenation of float or quantized weights: quantized ones of one type stay
    in it; a mix of types meets in Q8_0 (float parts included)."""
    if not any(isinstance(t, QuantizedTensor) for t in tensors):
        return torch.cat(tensors, dim=0)
    kinds = {t.qtype if isinstance(t, QuantizedTensor) else None for t in tensors}
    if len(kinds) == 1:
        return tensors[0].with_blocks(torch.cat([t.blocks for t in tensors], dim=0))
    floats = [t.dequantize() if isinstance(t, QuantizedTensor) else t.float() for t in tensors]
    return quantize(torch.cat(floats, dim=0), "q8_0")


def _stack_experts(sd: dict[str, torch.Tensor]) -> None:
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in sd if _EXPERT.fullmatch(n)]:
        prefix, expert, proj = _EXPERT.fullmatch(name).groups()
        groups.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = sd.pop(name)
    for prefix, projs in groups.items():
        count = 1 + max(max(p) for p in projs.values())
        for proj in ("gate_proj", "up_proj", "down_proj"):
            lacking = sorted(set(range(count)) - set(projs.get(proj, {})))
            if lacking:
                raise KeyError(f"{prefix} lacks {proj} of experts {lacking}")

        def stack(proj: str) -> torch.Tensor:  # B023: called in this iteration only
            return torch.stack([projs[proj][e] for e in range(count)])  # noqa: B023

        sd[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        sd[f"{prefix}.down_proj"] = stack("down_proj")
