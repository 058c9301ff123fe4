"""Rotary position embedding: its configuration (parsed from `config.json`) and cos / sin
tables over positions, computed in float32 the way transformers computes them.

Scaling types: `llama3`, `linear`, `yarn` (Qwen3's long-context setting), `longrope` (alias
`su`, Phi-3). LongRoPE note:
transformers recomputes the whole sequence with the long factors once a sequence grows past
`original_max_position_embeddings`, which a KV cache cannot do; here positions below it use
the short factors and positions from it on the long ones (as vLLM does). Below that length
(all of Phi-3-mini-4k, and every prompt shorter than 4k on the 128k models) the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from spruce.runtime.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str  # llama3 | linear | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    attention_factor: float = 1.0  # yarn, longrope: cos / sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    scaling: RopeScaling | None = None
    partial_factor: float = 1.0  # rotate only the first head_dim * partial_factor dims


SUPPORTED_SCALING = ("default", "llama3", "linear", "yarn", "longrope")


def rope_config(
    config: dict[str, Any], head_dim: int, max_pos: int
) -> tuple[RopeConfig, RopeConfig | None]:
    """(global layers' rope, sliding layers' rope or None when they are the same)."""
    # transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older
    # folders use rope_theta + rope_scaling (+ rope_local_base_freq).
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in params:
        local = params.get("sliding_attention")
        return _one(config, params["full_attention"], max_pos), (
            local and _one(config, local, max_pos)
        )
    local = config.get("rope_local_base_freq")
    return _one(config, params, max_pos), (
        None if local is None else RopeConfig(theta=float(local))
    )


def _one(config: dict[str, Any], params: dict[str, Any], max_pos: int) -> RopeConfig:
    theta = params.get("rope_theta") or config.get("rope_theta") or 10000.0
    partial = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    return RopeConfig(float(theta), _scaling(config, params, max_pos), float(partial))


def _scaling(config: dict[str, Any], params: dict[str, Any], max_pos: int) -> RopeScaling | None:
    kind = params.get("rope_type") or params.get("type")
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )
    if kind == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    if kind in ("longrope", "su"):
        return _longrope(config, params, max_pos)
    if kind == "yarn":
        return _yarn(config, params, max_pos)
    raise ModelLoadError(
        f"rope scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_SCALING)})"
    )


def _original_and_factor(kind: str, config: dict, params: dict, max_pos: int) -> tuple[int, float]:
    """(the pre-scaling context, the scaling factor) of a longrope / yarn config."""
    original = params.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings"
    )
    if original is None:
        raise ModelLoadError(f"{kind} rope scaling needs original_max_position_embeddings")
    return original, params.get("factor") or max_pos / original


def _longrope(config: dict[str, Any], params: dict[str, Any], max_pos: int) -> RopeScaling:
    original, factor = _original_and_factor("longrope", config, params, max_pos)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        "longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        short_factor=tuple(params["short_factor"]),
        long_factor=tuple(params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def _yarn(config: dict[str, Any], params: dict[str, Any], max_pos: int) -> RopeScaling:
    original, factor = _original_and_factor("yarn", config, params, max_pos)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeScaling(
        "yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_factor)


def check_rope(rope: RopeConfig, head_dim: int) -> None:
    dim = rotary_dim(rope, head_dim)
    if dim % 2 or dim <= 0:
        raise ModelLoadError(
            f"rotary dimension {dim} (head_dim {head_dim} x partial_rotary_factor) must be even"
        )
    s = rope.scaling
    if (
        s is not None
        and s.kind == "longrope"
        and not len(s.short_factor) == len(s.long_factor) == dim // 2
    ):
        raise ModelLoadError(f"longrope short_factor / long_factor need {dim // 2} entries each")


def rope_tables(
    rope: RopeConfig, head_dim: int, max_pos: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, rotary_dim / 2] in float32."""
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    positions = torch.arange(max_pos, dtype=torch.float32, device=device)
    s = rope.scaling
    if s is not None and s.kind == "longrope":
        return _longrope_tables(s, rope.theta, exponents, positions)
    if s is not None and s.kind == "yarn":
        freqs = torch.outer(positions, _yarn_inv_freq(s, rope.theta, dim, exponents))
        return freqs.cos() * s.attention_factor, freqs.sin() * s.attention_factor
    inv_freq = 1.0 / (rope.theta**exponents)
    if s is not None and s.kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, s)
    elif s is not None and s.kind == "linear":
        inv_freq = inv_freq / s.factor
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos(), freqs.sin()


def _longrope_tables(
    s: RopeScaling, theta: float, exponents: torch.Tensor, positions: torch.Tensor
):
    device = exponents.device
    short = 1.0 / (
        torch.tensor(s.short_factor, dtype=torch.float32, device=device) * theta**exponents
    )
    long = 1.0 / (
        torch.tensor(s.long_factor, dtype=torch.float32, device=device) * theta**exponents
    )
    is_long = (positions >= s.original_max_position_embeddings)[:, None]
    freqs = torch.where(is_long, torch.outer(positions, long), torch.outer(positions, short))
    return freqs.cos() * s.attention_factor, freqs.sin() * s.attention_factor


def _yarn_inv_freq(s: RopeScaling, theta: float, dim: int, exponents: torch.Tensor) -> torch.Tensor:
    """Extrapolated (original) frequencies for the fast dims, interpolated (/ factor) ones for
    the slow dims, a linear ramp between; as transformers' _compute_yarn_parameters."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = (
        ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low))
        .clamp(0, 1)
        .to(exponents.device)
    )
    extrapolation_weight = 1 - ramp
    pos_freqs = theta**exponents
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
