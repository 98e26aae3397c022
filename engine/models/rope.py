"""RoPE tables of every supported type: plain, linear, Llama 3 and YaRN scaling (as Hugging Face
transformers' ``modeling_rope_utils`` defines them), in the ``rope_cos_sin_cache`` layout of the
kernel ops: ``[max_position, head_dim]``, cos in the first half, sin in the second."""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """fp64 inverse frequencies ``[head_dim // 2]`` and the factor cos and sin are scaled by."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    if scaling.freq_factors is not None:
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float64), 1.0
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(inv_freq, head_dim, theta, scaling)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = scaling.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        old_len = scaling.original_max_position_embeddings
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # the share of each frequency left unscaled
    return inv_freq / factor * ramp + inv_freq * extrapolated, attention_factor


def rope_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None, device=None
) -> torch.Tensor:
    """fp32 ``[max_position, head_dim]`` table (cos, then sin, each times the attention factor)."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
    return table.to(device=device, dtype=torch.float32)
