"""Speculative decoding (n-gram prompt lookup) against plain decoding, measured in the same run.

Two workloads, greedy, SmolLM2's chat template:
  code_edit  the prompt holds a ~2K-token Python file and asks for the whole file back with a few
             edits (each of the 16 requests its own edits); the answer copies long spans
  chat       16 short questions with free-form answers: little to copy
For each, batch 1 (the first request) and batch 16: decode output tok/s with and without
``--speculative ngram`` (timed from the step after the last prefill to the end; prompts prefilled
and the file's prefix cached before the clock starts) and the mean acceptance length
(1 + accepted / drafts: tokens per verifying sequence-step). One JSON line each.

Three modes:
  cpu     (default) the real SmolLM2 GGUF, fp32: real acceptance. Writes the greedy outputs
          (identical with and without speculation; checked) to ``--trace-out`` for the replay.
  expected-trace  writes a trace of the answers a perfect model would give instead (no model
          runs): each code_edit answer is the edited file in a code block, each chat answer a
          README paragraph (prose, little repetition); ``--code-tokens``/``--chat-tokens`` long.
  replay  dummy weights of ``--shapes`` (smollm2-135m, llama3-8b) on CUDA, decoding a trace's
          outputs: each step runs the real forward, verification and sampling, then the committed
          tokens are replaced by the trace's (for a draft: its longest prefix that matches the
          trace, then the trace's next token, which is what greedy verification commits for a
          model that produced the trace). The proposer sees the same tokens, so it drafts as it
          would for that model: the acceptance is the trace's, the cost the shape's.

    .venv/bin/python benchmarks/spec_decode.py --trace-out /tmp/spec_decode_trace.json
    .venv/bin/python benchmarks/spec_decode.py --mode expected-trace --code-tokens 512 --chat-tokens 128 \
        --trace-out benchmarks/results/spec_decode_expected_trace.json
    python3 benchmarks/spec_decode.py --mode replay --trace spec_decode_expected_trace.json --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.model_runner import LaunchedStep
from engine.protocol import GenerateRequest, SamplingParams
from engine.scheduler import SampledToken, ScheduledSeq
from engine.warmup import warmup
from loadtest.stamp import emit

BATCHES = (1, 16)
EDITS = [
    ("compute_total", "compute_sum"), ("TAX_RATE = 0.2", "TAX_RATE = 0.25"), ("Inventory", "Stock"),
    ("def describe", "def summary"), ("max_items", "limit"), ("# helpers", "# utilities"),
    ("price", "cost"), ("Order", "Purchase"), ("quantity", "count"), ("discount", "rebate"),
    ("customer", "client"), ("warehouse", "depot"), ("shipping", "delivery"), ("total", "amount"),
    ("items", "entries"), ("report", "summary_text"),
]
QUESTIONS = [
    "What is the capital of France?", "Give me three tips for better sleep.", "Why is the sky blue?",
    "Write a haiku about autumn.", "How do vaccines work?", "What is a black hole?",
    "Suggest a name for a pet turtle.", "How do I boil an egg?", "What causes rain?",
    "Explain photosynthesis simply.", "What is the tallest mountain?", "Tell me a fun fact about cats.",
    "How does a bicycle stay upright?", "What is inflation?", "Recommend a book for a long flight.",
    "Why do leaves change colour?",
]


def source_file() -> str:
    """A ~2K-token Python module (an order-keeping toy), deterministic."""
    parts = ['"""Orders, inventory and reports for a small shop."""\n\nTAX_RATE = 0.2\n\n# helpers\n']
    for i in range(14):
        parts.append(f'''
class Order{i}:
    """An order of kind {i}: items, a customer and a warehouse."""

    def __init__(self, customer, items, warehouse="main", max_items={10 + i}):
        self.customer = customer
        self.items = list(items)[:max_items]
        self.warehouse = warehouse

    def compute_total(self, discount=0.0):
        total = sum(item.price * item.quantity for item in self.items)
        return round(total * (1 - discount) * (1 + TAX_RATE), 2)

    def describe(self):
        return f"order {i} for {{self.customer}}: {{len(self.items)}} items from {{self.warehouse}}"
''')
    parts.append('''

class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, name, quantity):
        self.stock[name] = self.stock.get(name, 0) + quantity

    def report(self):
        return "\\n".join(f"{name}: {count}" for name, count in sorted(self.stock.items()))
''')
    return "".join(parts)


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    code = source_file()
    edit_prompts, chat_prompts = [], []
    for old, new in EDITS:
        messages = [{"role": "user", "content": f"Here is a Python file:\n```python\n{code}```\n\n"
                     f"Rewrite the whole file, replacing `{old}` with `{new}` everywhere. "
                     "Output only the complete file in a code block."}]
        edit_prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        chat_prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return {"code_edit": [list(p) for p in edit_prompts], "chat": [list(p) for p in chat_prompts]}


class ReplayRunner:
    """Wraps a runner: each step runs for real, then commits the trace's tokens instead of the
    sampled ones (see the module docstring)."""

    def __init__(self, runner, outputs: dict[str, list[int]]):
        self.runner, self.outputs = runner, outputs

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        return LaunchedStep.on_host(self.execute(scheduled), graphed=False)

    def execute(self, scheduled: list[ScheduledSeq]) -> list[SampledToken]:
        sampled = self.runner.execute(scheduled)
        replayed, seen = [], set()
        for s in sampled:
            seq = s.seq
            if seq.key in seen:
                continue
            seen.add(seq.key)
            trace = self.outputs[seq.request_id]
            pos = len(seq.output_ids)
            accepted = 0
            for draft, expected in zip(seq.draft_ids, trace[pos:]):
                if draft != expected:
                    break
                accepted += 1
            replayed.extend(SampledToken(seq, t, None) for t in trace[pos : pos + accepted + 1])
        return replayed


def measure(core: EngineCore, prompts: list[list[int]], max_tokens: list[int], tag: str) -> dict:
    """Decode tok/s of ``prompts`` run together, after their prefill, and the speculation counters."""
    for i, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
        sampling = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        core.add_request(GenerateRequest(f"{tag}-{i}", prompt, sampling))
    outputs: dict[str, list[int]] = {}
    while any(len(outputs.get(f"{tag}-{i}", ())) == 0 for i in range(len(prompts))):
        for frame in core.step():
            outputs.setdefault(frame.request_id, []).extend(frame.token_ids)
    before = core.stats()
    first = sum(map(len, outputs.values()))
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while core.has_work():
        for frame in core.step():
            outputs[frame.request_id].extend(frame.token_ids)
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = core.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    decoded = sum(map(len, outputs.values())) - first
    return {
        "decode_tok_s": round(decoded / seconds, 1),
        "decoded_tokens": decoded,
        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
        "draft_acceptance_rate": round(accepted / (after.spec_num_draft_tokens - before.spec_num_draft_tokens), 3)
        if drafts else None,
        "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))],
    }


def run_grid(make_core, prompts: dict[str, list[list[int]]], max_tokens: dict[str, list[int]], extra: dict,
             num_speculative_tokens: int, check_identical: bool, on_spec_outputs=None) -> None:
    """Every workload × batch on one speculating engine, then on one plain engine (batch 16 after
    batch 1, so its prompts mostly hit the prefix cache: prefill is not timed anyway).
    ``on_spec_outputs`` gets the speculating engine's batch-16 outputs per workload."""
    results = {}
    for spec in (True, False):
        core = make_core(spec)
        for workload, batch_prompts in prompts.items():
            for batch in BATCHES:
                tag = f"{workload}-{batch}-{spec}"
                results[workload, batch, spec] = measure(core, batch_prompts[:batch], max_tokens[workload][:batch], tag)
        del core
        if spec and on_spec_outputs is not None:
            on_spec_outputs({workload: results[workload, max(BATCHES), True]["outputs"] for workload in prompts})
    for workload in prompts:
        for batch in BATCHES:
            plain, spec = results[workload, batch, False], results[workload, batch, True]
            if check_identical and plain["outputs"] != spec["outputs"]:
                raise AssertionError(f"{workload} batch {batch}: speculative outputs differ from plain ones")
            emit(benchmark="spec_decode", workload=workload, batch=batch,
                 plain_tok_s=plain["decode_tok_s"], spec_tok_s=spec["decode_tok_s"],
                 speedup=round(spec["decode_tok_s"] / plain["decode_tok_s"], 3),
                 mean_acceptance_length=spec["mean_acceptance_length"],
                 draft_acceptance_rate=spec["draft_acceptance_rate"], decoded_tokens=spec["decoded_tokens"],
                 num_speculative_tokens=num_speculative_tokens, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("cpu", "expected-trace", "replay"), default="cpu",
                        help="(default: %(default)s)")
    parser.add_argument("--trace", help="replay: the trace the cpu mode wrote")
    parser.add_argument("--trace-out", help="cpu: where to write the prompts and greedy outputs")
    parser.add_argument("--shapes", default="smollm2-135m,llama3-8b",
                        help="replay: dummy shapes (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="(default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=int,
                        default=EngineConfig.__dataclass_fields__["num_speculative_tokens"].default,
                        help="(default: %(default)s)")
    parser.add_argument("--code-tokens", type=int, default=384,
                        help="cpu: tokens per code_edit answer (default: %(default)s)")
    parser.add_argument("--chat-tokens", type=int, default=128,
                        help="cpu: tokens per chat answer (default: %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true", help="replay: no CUDA graphs")
    args = parser.parse_args()
    configure_logging("WARNING")
    k = args.num_speculative_tokens

    def engine_config(model: str, load_format: str, spec: bool, **settings) -> EngineConfig:
        return EngineConfig(
            model=model, load_format=load_format, device=args.device, max_num_batched_tokens=2048,
            max_num_seqs=16, speculative="ngram" if spec else None, num_speculative_tokens=k, **settings,
        )

    if args.mode == "expected-trace":
        from engine.protocol import default_model_path
        from gateway.tokenizer import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(str(default_model_path()), Path.home() / ".cache" / "kvgate")
        code = source_file()
        readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
        prose = [p for p in readme.split("\n\n") if len(p) > 400 and not p.startswith(("|", "```", "#"))]
        outputs = {
            "code_edit": [tokenizer.encode(f"```python\n{code.replace(old, new)}```", add_special_tokens=False)
                          [: args.code_tokens] for old, new in EDITS],
            "chat": [tokenizer.encode(p, add_special_tokens=False)[: args.chat_tokens] for p in prose[:16]],
        }
        assert len(outputs["chat"]) == 16
        Path(args.trace_out).write_text(json.dumps({"prompts": workloads(tokenizer), "outputs": outputs}))
        return

    if args.mode == "cpu":
        from engine.models.loader import load_model
        from engine.protocol import default_model_path
        from gateway.tokenizer import load_hf_tokenizer
        from kernels import load_ops

        path = str(default_model_path())
        tokenizer = load_hf_tokenizer(path, Path.home() / ".cache" / "kvgate")
        prompts = workloads(tokenizer)
        max_tokens = {"code_edit": [args.code_tokens] * 16, "chat": [args.chat_tokens] * 16}
        model, model_config = load_model(path, "gguf", torch.device("cpu"), torch.float32, load_ops("torch"))

        def make_core(spec: bool) -> EngineCore:
            config = engine_config("smollm2", "gguf", spec, num_kv_blocks=2048)
            return EngineCore.from_model(config, model, model_config)

        extra = {"mode": "cpu", "device": "cpu", "model": "SmolLM2-135M-Instruct Q4_1 GGUF, fp32",
                 "threads": torch.get_num_threads()}
        def write_trace(outputs: dict[str, list[list[int]]]) -> None:
            if args.trace_out:
                Path(args.trace_out).write_text(json.dumps({"prompts": prompts, "outputs": outputs}))

        run_grid(make_core, prompts, max_tokens, extra, k, check_identical=True, on_spec_outputs=write_trace)
        return

    trace = json.loads(Path(args.trace).read_text())
    prompts, outputs = trace["prompts"], trace["outputs"]
    max_tokens = {w: [len(o) for o in outs] for w, outs in outputs.items()}
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    by_id = {f"{w}-{batch}-{spec}-{i}": o for w, outs in outputs.items() for batch in BATCHES
             for spec in (False, True) for i, o in enumerate(outs)}
    for shape in args.shapes.split(","):
        def make_core(spec: bool, shape=shape) -> EngineCore:
            core = EngineCore.from_config(engine_config(shape, "dummy", spec, enforce_eager=args.enforce_eager))
            warmup(core)
            core.runner = ReplayRunner(core.runner, by_id)
            return core

        extra = {"mode": f"replay of {Path(args.trace).name}", "device": device_name, "shape": shape,
                 "cuda_graphs": args.device.startswith("cuda") and not args.enforce_eager}
        run_grid(make_core, prompts, max_tokens, extra, k, check_identical=False)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
