"""FP8 (E4M3) KV cache: the pool's dtype, and the per-layer, per-kv-head scales it is stored with.

Scales are per kv head of each layer, K and V apart, calibrated once at load: one prefill of a
fixed, seeded token sequence on an unquantized scratch cache, whose per-head absolute maximum
times ``HEADROOM`` maps to E4M3's largest value (448). Why per head: heads differ by orders of
magnitude (RoPE'd keys of a few heads carry outliers), and one scale per tensor spends the
exponent range of every head on the largest; E4M3 keeps 3 mantissa bits anywhere in its normal
range, so a per-head scale costs nothing where values are large and keeps small heads out of
the subnormals. Why at load, from a fixed sequence: the scales (and so every output) do not
depend on which request came first, and they are fixed before CUDA graphs capture their address.
Values past the calibrated range saturate at ±448 (never NaN). The kernels fold K's scale into
the softmax scale and V's into the output: no per-element multiply.
What the choice costs (benchmarks/fp8_kv_probe.py, SmolLM2): neither one scale of 1.0 nor a
scale per token and head agrees better with fp32 KV than these; K's 3 mantissa bits are the cost.

A prefix hit, an exact-position copy or a resumed prefill reads the quantized pages, as the
request that wrote them did: with an fp8 cache even a cold prefill attends to its own chunk
through the quantized cache, so cold and resumed runs read the same values.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.models.layers import Attention

FP8_KV = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_KV).max
# Calibration: one prefill of this many seeded random tokens; the scales leave this factor of
# room above the largest magnitude seen (an outlier past it saturates).
CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
HEADROOM = 2.0
_BLOCK_SIZE = 16


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: ``dtype`` (the weights') for ``auto``."""
    return FP8_KV if config.kv_cache_dtype == "fp8_e4m3" else dtype


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Set every attention layer's ``k_scale``/``v_scale`` (in place: their addresses stay) from
    one prefill of ``CALIBRATION_TOKENS`` seeded tokens on a scratch cache of ``dtype``; returns
    the ``[layers, 2, kv_heads]`` absolute maxima it saw, for logs and tests."""
    config = model.config
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    n = min(CALIBRATION_TOKENS, config.max_position_embeddings)
    num_blocks = -(-n // _BLOCK_SIZE)
    shape = (num_blocks, _BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    # one cache per layer, even where the pool shares a page between layer groups
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in layers]
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(config.vocab_size, (n,), generator=gen).to(device)
    positions = torch.arange(n, device=device)
    attn = AttentionMetadata(
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        slot_mapping=positions.clone(),
        seq_lens_cpu=[n], query_start_loc_cpu=[0, n], max_query_len=n, max_seq_len=n,
    )
    model(ids, positions, attn, caches)
    amax = torch.stack([
        torch.stack([c.float().abs().amax(dim=(0, 1, 3)) for c in pair]) for pair in caches
    ])
    for layer, (k_amax, v_amax) in zip(layers, amax):
        layer.k_scale.copy_((k_amax * HEADROOM / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny))
        layer.v_scale.copy_((v_amax * HEADROOM / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny))
    return amax
