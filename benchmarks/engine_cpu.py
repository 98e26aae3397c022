"""CPU engine throughput against HF transformers in the same run (SmolLM2-135M GGUF, fp32).

Prints one JSON line per measurement:
  prefill tok/s (one prompt of --prompt-len tokens), decode tok/s at batch 1 and at --batch,
  chunked prefill tok/s (--new-tokens after --cached-tokens already cached: an agent's next turn;
  HF runs the same tokens over its past_key_values), and the sidecar's decode tok/s over HTTP
  against the same engine offline (the cost of serving).
Run: .venv/bin/python benchmarks/engine_cpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.protocol import GenerateRequest, SamplingParams, default_model_path
from engine.warmup import warmup
from loadtest.stamp import emit


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 12000) for _ in range(length)] for _ in range(n)]


class Ours:
    def __init__(self, model_path: str, prompt_len: int, prefix_caching: bool = False):
        cfg = EngineConfig(model=model_path, max_num_batched_tokens=max(prompt_len, 2048), num_kv_blocks=2048,
                           enable_prefix_caching=prefix_caching)
        self.core = EngineCore.from_config(cfg)
        warmup(self.core)
        self.runs = 0

    def generate(self, batch: list[list[int]], max_tokens: int) -> float:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in batch:
            self.runs += 1
            self.core.add_request(GenerateRequest(f"r{self.runs}", p, sampling))
        t0 = time.perf_counter()
        while self.core.has_work():
            self.core.step()
        return time.perf_counter() - t0

    def extend(self, prefix: list[int], new: list[int]) -> float:
        """Seconds to prefill ``new`` after ``prefix``, which the prefix cache holds (one token out)."""
        self.generate([prefix], 1)  # cached (again, if evicted): only untimed work
        return self.generate([prefix + new], 1)


class HF:
    def __init__(self, model_path: str):
        from pathlib import Path

        from transformers import AutoModelForCausalLM

        path = Path(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], max_tokens: int) -> float:
        ids = torch.tensor(batch)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def extend(self, prefix: list[int], new: list[int]) -> float:
        """Seconds for one forward of ``new`` over the past_key_values of ``prefix`` (computed untimed)."""
        past = self.model(torch.tensor([prefix]), use_cache=True).past_key_values
        t0 = time.perf_counter()
        self.model(torch.tensor([new]), past_key_values=past, use_cache=True)
        return time.perf_counter() - t0


def measure(args, peers: dict) -> dict[str, dict[str, float]]:
    """Best of --repeats for every peer, the peers interleaved so that machine noise hits both."""
    (prompt,) = prompts(1, args.prompt_len, 1)
    workloads = {"prefill": ([prompt], 1)}
    for b in (1, args.batch):
        workloads[f"decode_b{b}_short"] = (prompts(b, 16, 2), 1)
        workloads[f"decode_b{b}_long"] = (prompts(b, 16, 2), args.decode_tokens + 1)
    best = {name: dict.fromkeys(workloads, float("inf")) for name in peers}
    for peer in peers.values():
        peer.generate(prompts(1, 16, 3), 2)  # first-call costs
    for _ in range(args.repeats):
        for key, (batch, max_tokens) in workloads.items():
            for name, peer in peers.items():
                best[name][key] = min(best[name][key], peer.generate(batch, max_tokens))
    results = {}
    for name, t in best.items():
        results[name] = {"prefill": args.prompt_len / t["prefill"]}
        for b in (1, args.batch):
            results[name][f"decode_b{b}"] = b * args.decode_tokens / (t[f"decode_b{b}_long"] - t[f"decode_b{b}_short"])
    return results


def measure_chunked(args, peers: dict) -> dict[str, float]:
    """Chunked-prefill tok/s per peer: best of --repeats, a fresh new part each time, peers interleaved."""
    (prefix,) = prompts(1, args.cached_tokens, 4)
    best = dict.fromkeys(peers, float("inf"))
    for r in range(args.repeats):
        (new,) = prompts(1, args.new_tokens, 10 + r)
        for name, peer in peers.items():
            best[name] = min(best[name], peer.extend(prefix, new))
    return {name: args.new_tokens / t for name, t in best.items()}


def bench_served(args, model_path: str) -> float:
    """Decode tok/s at --batch through the sidecar (streamed msgpack over HTTP)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--port", str(port), "--model", model_path,
         "--num-kv-blocks", "2048", "--no-prefix-caching", "--log-level", "WARNING"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        batch = prompts(args.batch, 16, 2)

        async def one(client, i, n, tag):
            req = GenerateRequest(f"{tag}-{i}", batch[i],
                                  SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            async with client.stream("POST", f"{url}/generate", content=req.pack()) as resp:
                async for _ in resp.aiter_raw():
                    pass

        async def run(n, tag):
            async with httpx.AsyncClient(timeout=600) as client:
                t0 = time.perf_counter()
                await asyncio.gather(*(one(client, i, n, tag) for i in range(args.batch)))
                return time.perf_counter() - t0

        asyncio.run(run(2, "warm"))
        t_short = min(asyncio.run(run(1, f"s{r}")) for r in range(args.repeats))
        t_long = min(asyncio.run(run(args.decode_tokens + 1, f"l{r}")) for r in range(args.repeats))
        return args.batch * args.decode_tokens / (t_long - t_short)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cached-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    configure_logging("WARNING")  # stdout carries only the JSON lines
    model_path = str(default_model_path())
    env = {"threads": torch.get_num_threads(), "torch": torch.__version__,
           "model": "SmolLM2-135M-Instruct Q4_1 GGUF, fp32"}
    hf_peer = HF(model_path)
    results = measure(args, {"kvgate": Ours(model_path, args.prompt_len), "hf": hf_peer})
    ours, hf = results["kvgate"], results["hf"]
    chunked = measure_chunked(args, {"kvgate": Ours(model_path, args.new_tokens, prefix_caching=True), "hf": hf_peer})
    emit(metric="prefill_tok_s", prompt_len=args.prompt_len, kvgate=round(ours["prefill"], 1),
         hf_transformers=round(hf["prefill"], 1), ratio=round(ours["prefill"] / hf["prefill"], 2), **env)
    for b in (1, args.batch):
        key = f"decode_b{b}"
        emit(metric="decode_tok_s", batch=b, kvgate=round(ours[key], 1), hf_transformers=round(hf[key], 1),
             ratio=round(ours[key] / hf[key], 2), **env)
    emit(metric="chunked_prefill_tok_s", cached_tokens=args.cached_tokens, new_tokens=args.new_tokens,
         kvgate=round(chunked["kvgate"], 1), hf_transformers=round(chunked["hf"], 1),
         ratio=round(chunked["kvgate"] / chunked["hf"], 2), **env)
    served = bench_served(args, model_path)
    emit(metric="served_decode_tok_s", batch=args.batch, sidecar_http=round(served, 1),
         offline=round(ours[f"decode_b{args.batch}"], 1),
         ratio=round(served / ours[f"decode_b{args.batch}"], 3), **env)


if __name__ == "__main__":
    main()
