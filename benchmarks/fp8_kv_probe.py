"""Where FP8 KV's greedy disagreement comes from, on SmolLM2 (CPU, fp32, reference ops).

The fp32 model generates 32 greedy tokens for each of the 20 accuracy prompts (the peer); each
variant then runs one prefill of prompt + those tokens and predicts every position (teacher
forcing). Its first wrong prediction is where its own greedy run would diverge (until then both
runs see the same context), so ``agreement`` is accuracy.py's measure. Variants round K and/or V
through E4M3 before an fp32 cache stores them: the engine's calibrated per-head scales on K and
V (it matches the engine's own fp8 cache), on K only, on V only, one scale of 1.0 (vLLM's
default), a scale per token and head (each value's own range: the best any scale choice could
do), the calibrated scales without their headroom, and bf16 rounding (8 bits of mantissa to
E4M3's 4). The calibration line compares the calibrated absolute maxima with those the prompts
reach. One JSON line per variant:

    python benchmarks/fp8_kv_probe.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.accuracy import smollm2_prompts
from engine.attention import AttentionMetadata
from engine.kv_quant import HEADROOM, calibrate_kv_scales
from engine.models.layers import Attention
from engine.models.loader import load_model
from engine.protocol import default_model_path
from kernels import load_ops, reference
from loadtest.stamp import emit

NEW_TOKENS = 32
BLOCK = 16
FP8 = torch.float8_e4m3fn
Rounding = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [t, heads, dim], scale [heads])


def through_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` stored as the engine's fp8 cache stores it, read back."""
    s = scale[:, None]
    return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)


def per_token(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each token's head over its own absolute maximum (``scale`` unused)."""
    s = (x.float().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return ((x.float() / s).to(FP8).float() * s).to(x.dtype)


def unchanged(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x


class RoundingOps:
    """The reference op set, K and V rounded by ``round_k``/``round_v`` (with the layer's scales)
    before they are stored; the cache is an fp32 one, so attention reads the rounded values."""

    def __init__(self, round_k: Rounding, round_v: Rounding, observe: Callable | None = None) -> None:
        self.round_k, self.round_v, self.observe = round_k, round_v, observe

    def __getattr__(self, name: str):
        return getattr(reference, name)

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        if self.observe:
            self.observe(key, value)
        reference.store_kv(self.round_k(key, k_scale), self.round_v(value, v_scale), k_cache, v_cache, slot_mapping)

    def paged_attention(self, *args, k_scale=None, v_scale=None, **kwargs):
        return reference.paged_attention(*args, **kwargs)


def use_ops(model: torch.nn.Module, ops) -> None:
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def run(model, ids: list[int], start: int, caches, num_blocks: int) -> torch.Tensor:
    """Log-probabilities of the tokens after each of ``ids`` (positions ``start`` on)."""
    end = start + len(ids)
    attn = AttentionMetadata(
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], seq_lens=torch.tensor([end], dtype=torch.int32),
        query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32), slot_mapping=torch.arange(start, end),
        seq_lens_cpu=[end], query_start_loc_cpu=[0, len(ids)], max_query_len=len(ids), max_seq_len=end,
    )
    hidden = model(torch.tensor(ids), torch.arange(start, end), attn, caches)
    return model.compute_logits(hidden).log_softmax(-1)


def fresh_caches(model, tokens: int):
    config = model.config
    num_blocks = -(-tokens // BLOCK)
    shape = (num_blocks, BLOCK, config.num_kv_heads, config.head_dim)
    layers = sum(isinstance(m, Attention) for m in model.modules())
    return num_blocks, [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]


@torch.inference_mode()
def greedy(model, prompt: list[int]) -> list[int]:
    num_blocks, caches = fresh_caches(model, len(prompt) + NEW_TOKENS)
    token = int(run(model, prompt, 0, caches, num_blocks)[-1].argmax())
    out = [token]
    for _ in range(NEW_TOKENS - 1):
        token = int(run(model, [token], len(prompt) + len(out) - 1, caches, num_blocks)[-1].argmax())
        out.append(token)
    return out


@torch.inference_mode()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[NEW_TOKENS, vocab]`` log-probabilities at the generated positions."""
    num_blocks, caches = fresh_caches(model, len(prompt) + NEW_TOKENS)
    return run(model, prompt + tokens[:-1], 0, caches, num_blocks)[len(prompt) - 1:]


def score(model, prompts, peers) -> dict:
    agreed, deltas, full = 0, [], 0
    for prompt, (tokens, peer_logprobs) in zip(prompts, peers):
        logprobs = teacher_forced(model, prompt, tokens)
        n = 0
        while n < NEW_TOKENS and int(logprobs[n].argmax()) == tokens[n]:
            deltas.append(abs(float(logprobs[n, tokens[n]]) - peer_logprobs[n]))
            n += 1
        agreed += n
        full += n == NEW_TOKENS
    return dict(agreement=round(agreed / (NEW_TOKENS * len(prompts)), 4),
                mean_abs_dlogprob=round(sum(deltas) / max(len(deltas), 1), 5), prompts_fully_agreed=full)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # small single-sequence steps: one thread is as fast, and repeatable
    model, _ = load_model(str(default_model_path()), "gguf", "cpu", torch.float32, load_ops("torch"))
    prompts = smollm2_prompts()
    peers = []
    for prompt in prompts:
        tokens = greedy(model, prompt)
        logprobs = teacher_forced(model, prompt, tokens)
        peers.append((tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]))
    calibrated = calibrate_kv_scales(model, torch.device("cpu"), torch.float32)  # [layers, 2, kv_heads]
    seen = torch.zeros_like(calibrated)
    layer = iter(range(10**9))
    num_layers = calibrated.shape[0]

    def observe(key: torch.Tensor, value: torch.Tensor) -> None:
        i = next(layer) % num_layers
        seen[i, 0] = torch.maximum(seen[i, 0], key.abs().amax((0, 2)))
        seen[i, 1] = torch.maximum(seen[i, 1], value.abs().amax((0, 2)))

    use_ops(model, RoundingOps(unchanged, unchanged, observe))
    for prompt, (tokens, _) in zip(prompts, peers):
        teacher_forced(model, prompt, tokens)
    ratio = seen / calibrated
    emit(bench="fp8_kv_probe", variant="calibration", model="smollm2-135m",
         prompt_over_calibrated_amax_max=round(float(ratio.max()), 3),
         heads_past_the_headroom=round(float((ratio > HEADROOM).float().mean()), 4),
         k_calibrated_amax_range=[round(float(calibrated[:, 0].min()), 3), round(float(calibrated[:, 0].max()), 3)],
         v_calibrated_amax_range=[round(float(calibrated[:, 1].min()), 3), round(float(calibrated[:, 1].max()), 3)])

    def with_scales(scales: torch.Tensor | None, round_k: Rounding, round_v: Rounding) -> dict:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        if scales is not None:
            for attention, (k, v) in zip(layers, scales):
                attention.k_scale.copy_(k)
                attention.v_scale.copy_(v)
        use_ops(model, RoundingOps(round_k, round_v))
        return score(model, prompts, peers)

    calibrated_scales = calibrated * HEADROOM / 448
    bf16 = lambda x, s: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    variants = {
        "k_and_v_calibrated": (calibrated_scales, through_fp8, through_fp8),
        "k_only": (calibrated_scales, through_fp8, unchanged),
        "v_only": (calibrated_scales, unchanged, through_fp8),
        "scale_1": (torch.ones_like(calibrated), through_fp8, through_fp8),
        "per_token_and_head": (None, per_token, per_token),
        "calibrated_without_headroom": (calibrated / 448, through_fp8, through_fp8),
        "bf16_kv": (None, bf16, bf16),
    }
    for name, (scales, round_k, round_v) in variants.items():
        emit(bench="fp8_kv_probe", variant=name, model="smollm2-135m", peer="fp32 KV", prompts=len(prompts),
             new_tokens=NEW_TOKENS, **with_scales(scales, round_k, round_v))


if __name__ == "__main__":
    main()
