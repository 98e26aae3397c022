"""What a JSON-schema constraint costs the engine: output tokens/s with and without it, same run.

For each batch size, the same greedy requests run twice through ``EngineCore.step``: under a JSON
schema (a grammar mask on every row, every step), then unconstrained (the peer) for as many decode
steps at the same contexts. Each record gives
output tok/s of both and the slowdown; then the schema's compile time, cold and cached.

On the CPU the model is SmolLM2's GGUF (weights and vocabulary). Elsewhere, e.g. on a GPU host
without the GGUF, ``--model smollm2-135m --load-format dummy --vocab FILE`` runs dummy weights of
the shape with the vocabulary saved by ``--save-vocab FILE`` on a machine that has the GGUF (random
weights make arbitrary but valid JSON; the mask's cost does not depend on what is sampled).

    python3 benchmarks/structured_outputs.py [--batches 1,32] [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig
from engine.core import EngineCore, resolve_dtype
from engine.logs import configure_logging
from engine.models.loader import load_model, load_tokenizer_info
from engine.protocol import GenerateRequest, SamplingParams, StructuredOutput, default_model_path
from engine.warmup import warmup
from kernels import load_ops
from loadtest.stamp import emit

# A typical tool-call-like schema: nested objects, an array, enums, bounded numbers.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
            },
            "required": ["city", "unit", "days", "tags"],
        },
    },
    "required": ["name", "arguments"],
}


def make_core(args: argparse.Namespace) -> tuple[EngineCore, list[bytes]]:
    """The engine, warmed up, and its vocabulary's token bytes."""
    import xgrammar as xgr

    config = EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                          max_num_seqs=max(args.batches), max_num_batched_tokens=4096)
    model, model_config = load_model(config.model, config.load_format, torch.device(config.device),
                                     resolve_dtype(config), load_ops(config.resolved_kernel_backend))
    if args.vocab is not None:
        info = xgr.TokenizerInfo.deserialize_json(args.vocab.read_text())
    else:
        info = load_tokenizer_info(config.model, config.load_format, model_config)
    if args.save_vocab is not None:
        args.save_vocab.write_text(info.serialize_json())
    core = EngineCore.from_model(config, model, model_config, info)
    warmup(core)
    return core, info.decoded_vocab


class Result:
    """Output tok/s of ``batch`` requests decoding together, over the steps in which every one of them
    still decodes (a constrained answer may end early; a smaller batch would not compare); how many
    such steps there were; and each request's tokens and finish reason."""

    def __init__(self, core: EngineCore, batch: int, tokens: int, structured: StructuredOutput | None, tag: str):
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=structured is None,
                                  structured=structured)
        for i in range(batch):
            core.add_request(GenerateRequest(f"{tag}-{i}", [100 + i, 200, 300 + i, 400], sampling))
        self.tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(batch)}
        self.finish: dict[str, str] = {}
        seconds, self.steps = 0.0, 0
        while core.has_work():
            t0 = time.perf_counter()
            frames = core.step()
            if core.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            for f in frames:
                self.tokens[f.request_id] += f.token_ids
                if f.finish_reason is not None:
                    self.finish[f.request_id] = f.finish_reason
            if all(len(t) > 1 for t in self.tokens.values()) and sum(len(f.token_ids) for f in frames) == batch:
                seconds += elapsed  # a decode step of the whole batch (the prefill step is not one)
                self.steps += 1
        self.tok_s = self.steps * batch / seconds

    def valid_json(self, decoded_vocab: list[bytes]) -> int:
        """How many of the answers that ended "stop" parse as JSON."""
        valid = 0
        for rid, reason in self.finish.items():
            text = b"".join(decoded_vocab[t] for t in self.tokens[rid]).decode(errors="replace")
            try:
                json.loads(text)
            except ValueError:
                continue
            valid += reason == "stop"
        return valid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_path()), help="GGUF, HF dir or dummy shape")
    parser.add_argument("--load-format", default="auto", help="auto, gguf, hf or dummy")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=Path, help="an xgrammar TokenizerInfo JSON (for dummy weights)")
    parser.add_argument("--save-vocab", type=Path, help="write the model's vocabulary there for --vocab")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes (default: 1,32)")
    parser.add_argument("--tokens", type=int, default=200, help="max output tokens per request (default: 200)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (default: 2)")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    configure_logging("WARNING")
    core, decoded = make_core(args)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    for batch in args.batches:
        for repeat in range(args.repeats):
            constrained = Result(core, batch, args.tokens, structured, f"json{batch}-{repeat}")
            # The peer decodes as many full-batch steps at the same contexts (attention grows with them).
            plain = Result(core, batch, constrained.steps + 2, None, f"plain{batch}-{repeat}")
            finished = sum(r == "stop" for r in constrained.finish.values())
            emit(bench="structured_outputs", device=core.device.type, model=core.model_config.name, batch=batch,
                 plain_tok_s=round(plain.tok_s, 1), json_schema_tok_s=round(constrained.tok_s, 1),
                 json_schema_full_batch_steps=constrained.steps, slowdown=round(1 - constrained.tok_s / plain.tok_s, 4),
                 json_schema_stopped=finished, json_schema_valid=constrained.valid_json(decoded),
                 goal="<= 0.10 slowdown at batch 32" if batch == 32 else None)
    for name, spec in (("cold", {**SCHEMA, "title": f"fresh-{time.time_ns()}"}), ("cached", SCHEMA)):
        t0 = time.perf_counter()
        core.compile_structured(StructuredOutput("json_schema", json.dumps(spec)))
        emit(bench="structured_compile", schema=name, ms=round((time.perf_counter() - t0) * 1e3, 3),
             goal="cold <= 50 ms" if name == "cold" else "cached ~0")


if __name__ == "__main__":
    main()
