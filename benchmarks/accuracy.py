"""Greedy agreement of an engine variant (FP8 KV cache, FP8 weights; on the CPU also bf16 weights
and KV, int8 and int4 weights) with its fp32, unquantized peer, the same weights in both.

Both engines generate greedily from the same prompts, with logprobs. Per prompt, the tokens agree
up to the first divergence; ``agreement`` is the agreed tokens over all generated tokens (a
divergence costs every token after it). ``mean_abs_dlogprob`` is the mean |Δ logprob| of the
peer's token over the agreed positions (same context on both sides).

On the CPU (SmolLM2 from its GGUF, fp32, torch reference ops), one JSON line per variant; then
the floor of the measure (the bf16 model against the fp32 one) and fp8 KV against bf16 KV:

    python benchmarks/accuracy.py [--max-tokens 32] [--variants int8_weights] [--one-at-a-time] [--no-floor]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.core import EngineCore
from engine.protocol import GenerateRequest, SamplingParams

# 20 chat prompts (texts and ids: SmolLM2's chat template, tokenized by the GGUF's own tokenizer)
PROMPTS_FILE = Path(__file__).with_name("smollm2_prompts.json")


def smollm2_prompts() -> list[list[int]]:
    return json.loads(PROMPTS_FILE.read_text())["prompt_ids"]


@dataclass(frozen=True, slots=True)
class Agreement:
    agreed_tokens: int
    total_tokens: int
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    prompts_fully_agreed: int

    @property
    def agreement(self) -> float:
        return self.agreed_tokens / self.total_tokens

    def record(self) -> dict:
        return dict(agreement=round(self.agreement, 4), agreed_tokens=self.agreed_tokens,
                    total_tokens=self.total_tokens, mean_abs_dlogprob=round(self.mean_abs_dlogprob, 5),
                    max_abs_dlogprob=round(self.max_abs_dlogprob, 5), prompts_fully_agreed=self.prompts_fully_agreed)


def generate(core: EngineCore, prompts: list[list[int]], max_tokens: int,
             one_at_a_time: bool = False) -> list[list[tuple[int, float]]]:
    """Greedy ``(token, logprob)`` lists, every prompt submitted at once (they batch), or each
    alone (decode steps of one row)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out: dict[str, list[tuple[int, float]]] = {f"acc{i}": [] for i in range(len(prompts))}
    for i, (rid, prompt) in enumerate(zip(out, prompts)):
        core.add_request(GenerateRequest(rid, prompt, sampling))
        if not (one_at_a_time or i == len(prompts) - 1):
            continue
        while core.has_work():
            for frame in core.step():
                out[frame.request_id] += [(t, lp.logprob) for t, lp in zip(frame.token_ids, frame.logprobs or [])]
    return list(out.values())


def agreement(
    reference: list[list[tuple[int, float]]], tested: list[list[tuple[int, float]]]
) -> Agreement:
    """Compare ``generate``'s outputs of the peer (``reference``) and of a variant."""
    agreed, deltas, full = 0, [], 0
    for ref, got in zip(reference, tested, strict=True):
        n = 0
        while n < len(ref) and ref[n][0] == got[n][0]:
            deltas.append(abs(ref[n][1] - got[n][1]))
            n += 1
        agreed += n
        full += n == len(ref)
    total = sum(map(len, reference))
    return Agreement(agreed, total, sum(deltas) / max(len(deltas), 1), max(deltas, default=0.0), full)


def set_kv_scales(model: torch.nn.Module, value: float) -> None:
    """One static scale for every head (vLLM's default is 1.0): the alternative to calibration."""
    for name, buffer in model.named_buffers():
        if name.endswith(("k_scale", "v_scale")):
            buffer.fill_(value)


def main() -> None:
    from engine.config import EngineConfig
    from engine.models.loader import load_model
    from engine.protocol import default_model_path
    from kernels import load_ops
    from loadtest.stamp import emit

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--variants", type=lambda v: v.split(","), default=None, help="only these (default: all)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="each prompt generated alone (decode steps of one row), not all at once")
    parser.add_argument("--no-floor", action="store_true", help="skip the bf16 runs (the floor of the measure)")
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts = smollm2_prompts()
    path = str(default_model_path())

    def core(dtype: torch.dtype = torch.float32, **settings) -> EngineCore:
        model, config = load_model(path, "gguf", "cpu", dtype, load_ops("torch"))
        return EngineCore.from_model(EngineConfig(model="smollm2", dtype=str(dtype).removeprefix("torch."),
                                                  **settings), model, config)

    def run(candidate: EngineCore) -> list[list[tuple[int, float]]]:
        return generate(candidate, prompts, args.max_tokens, args.one_at_a_time)

    def report(variant: str, peer: str, reference: list, candidate: EngineCore) -> None:
        emit(bench="accuracy", device="cpu", model="smollm2-135m", variant=variant, peer=peer,
             prompts=len(prompts), max_tokens=args.max_tokens, one_at_a_time=args.one_at_a_time,
             **agreement(reference, run(candidate)).record())

    reference = run(core())
    variants = {
        "fp8_kv": dict(kv_cache_dtype="fp8_e4m3"),
        "fp8_kv_scale_1": dict(kv_cache_dtype="fp8_e4m3"),
        "fp8_weights": dict(quantization="fp8"),
        "fp8_weights_and_kv": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
        "fp8_weights_and_lm_head": dict(quantization="fp8", fp8_lm_head=True),
        "int8_weights": dict(quantization="int8"),
        "int4_weights": dict(quantization="int4"),
        # the quantized weights on the bf16 model (activations, norms, attention and KV in bf16)
        "int8_weights_bf16": dict(quantization="int8", dtype=torch.bfloat16),
        "int4_weights_bf16": dict(quantization="int4", dtype=torch.bfloat16),
    }
    for name in args.variants or variants:
        settings = variants[name]
        candidate = core(**settings)
        if name == "fp8_kv_scale_1":
            set_kv_scales(candidate.runner.model, 1.0)
        report(name, "fp32", reference, candidate)
    if args.no_floor:
        return
    # The floor of the measure: the same model in bf16 (weights, activations and KV) against fp32;
    # then fp8 KV against bf16 KV, both on the bf16 model.
    report("bf16", "fp32", reference, core(torch.bfloat16))
    report("fp8_kv_on_bf16", "bf16", run(core(torch.bfloat16)),
           core(torch.bfloat16, kv_cache_dtype="fp8_e4m3"))


if __name__ == "__main__":
    main()
