"""Tensor parallelism on the CPU with gloo, two ranks: the sharding transform of every family
against the single-device model, the engine (rank 0 + a follower process) against TP=1 on 20
prompts, and a follower killed under load."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import msgpack
import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged import PagedKV, peaky_tiny
from starlette.testclient import TestClient
from test_families import save_hf
from test_server import ROOT, free_port, post, wait_ready

from engine.config import FULL_ATTENTION, SLIDING_ATTENTION, EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.model_runner import ModelRunner
from engine.models import build_model
from engine.models.tp import head_split, local_config, shard_model
from engine.offline import run_offline
from engine.parallel import TensorParallelRanks
from engine.protocol import MSGPACK, GenerateRequest, OutputFrame, SamplingParams
from engine.server import build_app
from kernels import load_ops

WORLD = 2
_SHAPE = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_layers=2, head_dim=16,
              max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
# Fewer KV heads than ranks (replicated), an uneven split (SmolLM2's 3 KV heads), a bias, q/k
# norms, sliding-window layers with their own RoPE base; the odd vocabulary pads the last shard.
FAMILIES = {
    "llama-kv1": ModelConfig(name="llama-kv1", num_heads=4, num_kv_heads=1, **_SHAPE),
    "llama-kv3": ModelConfig(name="llama-kv3", num_heads=6, num_kv_heads=3, tie_word_embeddings=False, **_SHAPE),
    "qwen2": ModelConfig(name="qwen2", num_heads=4, num_kv_heads=2, architecture="qwen2", **_SHAPE),
    "qwen3-kv1": ModelConfig(name="qwen3-kv1", num_heads=4, num_kv_heads=1, architecture="qwen3",
                             tie_word_embeddings=False, **_SHAPE),
    "gemma3": ModelConfig(name="gemma3", num_heads=4, num_kv_heads=1, architecture="gemma3",
                          layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=8,
                          local_rope_theta=10000.0, query_pre_attn_scalar=16, **_SHAPE),
}
CHUNKS = [  # a prefill of three sequences in two chunks each, then decodes
    {0: list(range(3, 30)), 1: list(range(100, 105)), 2: list(range(200, 240))},
    {0: list(range(30, 45)), 1: [7, 8], 2: list(range(240, 252))},
    *({0: [11 + i], 1: [12 + i], 2: [13 + i]} for i in range(4)),
]


def _model(config: ModelConfig):
    """``config``'s model with seeded random weights: the same in every process."""
    model = build_model(config, load_ops("torch"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model


def _logits(model, config: ModelConfig) -> list[torch.Tensor]:
    kv = PagedKV(config, num_blocks=32, block_size=4)
    return [kv.step(model, chunks) for chunks in CHUNKS]


def _rank(rank: int, address: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=WORLD)
    results = {}
    for name, config in FAMILIES.items():
        sharded = shard_model(_model(config), WORLD, rank, dist.group.WORLD)
        results[name] = _logits(sharded, sharded.config)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_head_split_covers_every_head_once():
    smollm2 = dataclasses.replace(FAMILIES["llama-kv3"], num_heads=9)
    assert [head_split(smollm2, 2, r) for r in range(2)] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    kv1 = FAMILIES["llama-kv1"]
    assert [head_split(kv1, 2, r) for r in range(2)] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    assert local_config(kv1, 2, 1).num_kv_heads == 1 and local_config(kv1, 2, 1).intermediate_size == 48
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        head_split(kv1, 3, 0)  # 3 ranks cannot share one KV head's 4 query heads


def test_sharded_families_match_the_single_device_model(tmp_path):
    """Two gloo ranks (spawned here) against the unsharded model: every step's logits close, argmax equal."""
    address = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(_rank, args=(address, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    sharded = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, config in FAMILIES.items():
        expected = _logits(_model(config), config)
        max_diff = 0.0
        for step, want in enumerate(expected):
            for rank in range(WORLD):  # every rank gathers the full logits
                got = sharded[rank][name][step]
                assert got.shape == want.shape
                max_diff = max(max_diff, (got - want).abs().max().item())
                assert torch.equal(got.argmax(-1), want.argmax(-1)), (name, step)
        print(f"{name}: max |logit TP2 - TP1| = {max_diff:.3g}")
        assert max_diff < 1e-4, name


def _prompts() -> list[str]:
    """20 greedy requests: random prompts of 3-90 tokens, some sharing a 40-token prefix (prefix
    hits across chunked prefills) with cache boundaries (exact-position entries: page copies), some
    asking for prompt logprobs (logits of every prompt position)."""
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 1000, (40,), generator=generator).tolist()
    lines = []
    for i in range(20):
        length = int(torch.randint(3, 90, (1,), generator=generator))
        prompt = torch.randint(3, 1000, (length,), generator=generator).tolist()
        request = {"prompt_ids": shared + prompt if i % 3 == 0 else prompt, "max_tokens": 8, "temperature": 0,
                   "logprobs": 5}
        if i % 3 == 0:
            request["cache_boundaries"] = [37]
        if i % 5 == 1:
            request["prompt_logprobs"] = 2
        lines.append(json.dumps(request))
    return lines


def _generate(core: EngineCore, lines: list[str]) -> list[dict]:
    out = io.StringIO()
    run_offline(core, lines, out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _compare_tp(settings: dict, lines: list[str], graphs: bool = False, async_scheduling: bool = False) -> float:
    """Greedy tokens of TP=2 equal TP=1's (eager); returns the largest difference of the logprobs.
    With ``graphs``, TP=2's decode steps go through every rank's decode graphs (on the CPU their
    padded buffers run eagerly, with the same broadcasts as a replay); with ``async_scheduling``, TP=2
    overlaps its steps (rank 0 carries the tokens in flight into the inputs it broadcasts)."""
    single = _generate(EngineCore.from_config(EngineConfig(**settings)), lines)
    ranks = TensorParallelRanks(EngineConfig(**settings, tensor_parallel_size=WORLD, async_scheduling=async_scheduling))
    try:
        core = ranks.build_core()
        if graphs:
            core.runner.capture_decode_graphs()
        parallel = _generate(core, lines)
        core.check_integrity()
    finally:
        ranks.close()
    assert [r["token_ids"] for r in parallel] == [r["token_ids"] for r in single]
    assert [r["num_cached_tokens"] for r in parallel] == [r["num_cached_tokens"] for r in single]
    assert any(r["num_cached_tokens"] for r in single)  # the prefix cache served some prompts
    assert len({t for r in single for t in r["token_ids"]}) > 10  # a model that says more than one thing
    return max(abs(a - b) for p, s in zip(parallel, single) for a, b in zip(_logprobs(p), _logprobs(s), strict=True))


def _logprobs(result: dict) -> list[float]:
    """Every logprob value of an offline result: the sampled tokens' top 5 and the prompt's."""
    entries = result["logprobs"] + result.get("prompt_logprobs", [])
    return [value for entry in entries for _, value in entry["top"]] + [entry["logprob"] for entry in entries]


def test_tp2_engine_greedy_identical_tiny_kv_heads_fewer_than_ranks(tmp_path):
    """A tiny Qwen3 with one KV head (replicated on both ranks), saved by transformers."""
    save_hf(tmp_path, "qwen3", num_key_value_heads=1, vocab_size=1000)
    settings = dict(model=str(tmp_path), load_format="hf", num_kv_blocks=256, max_num_batched_tokens=64)
    max_diff = _compare_tp(settings, _prompts())
    print(f"tiny qwen3 kv1: max |logprob TP2 - TP1| = {max_diff:.3g}")
    assert max_diff < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_engine_greedy_identical_tiny_gemma3(tmp_path, async_scheduling):
    """A tiny Gemma 3 (sliding-window layers: two KV layer groups, each with its own block tables;
    one KV head, replicated), saved by transformers; decode steps through the ranks' decode graphs."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, sliding_window=16,
        query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    settings = dict(model=str(tmp_path), load_format="hf", num_kv_blocks=256, max_num_batched_tokens=64)
    max_diff = _compare_tp(settings, _prompts(), graphs=True, async_scheduling=async_scheduling)
    print(f"tiny gemma3: max |logprob TP2 - TP1| = {max_diff:.3g}")
    assert max_diff < 1e-4


@pytest.mark.slow
def test_tp2_engine_greedy_identical_smollm2(gguf_path):
    """SmolLM2-135M (9 heads, 3 KV heads: rank 0 holds 6 and 2, rank 1 holds 3 and 1), fp32."""
    settings = dict(model=str(gguf_path), num_kv_blocks=256, max_num_batched_tokens=64)
    max_diff = _compare_tp(settings, _prompts()[:10])  # the real model's steps are the slow part: half the set
    print(f"SmolLM2: max |logprob TP2 - TP1| = {max_diff:.3g}")
    assert max_diff < 1e-3


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "thread"])
def test_a_dead_rank_fails_the_engine(tmp_path, engine_process):
    """Kill the follower mid-request: the request ends with an error, health goes red, new requests
    get 503, and the sidecar still answers and exits, all in bounded time. Rank 0 is the engine process
    (the follower its child), or the HTTP process itself."""
    port = free_port()
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--port", str(port), "--model", "tiny", "--load-format",
             "dummy", "--num-kv-blocks", "128", "--tensor-parallel-size", "2", "--cpu-threads", "1",
             "--engine-process" if engine_process else "--no-engine-process"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log_path)
        rank0 = spawned_children(proc.pid)[0] if engine_process else psutil.Process(proc.pid)
        follower = spawned_children(rank0.pid)[0]
        request = GenerateRequest("long", list(range(5, 40)), SamplingParams(max_tokens=980, ignore_eos=True,
                                                                               temperature=0.0))
        start = time.time()
        frames = []
        with httpx.stream("POST", f"{url}/generate", content=request.pack(),
                          headers={"content-type": "application/x-msgpack"}, timeout=60) as resp:
            unpacker = msgpack.Unpacker(strict_map_key=False)
            for chunk in resp.iter_bytes():
                unpacker.feed(chunk)
                frames += [OutputFrame.from_wire(m) for m in unpacker]
                if frames and follower.is_running():
                    os.kill(follower.pid, signal.SIGKILL)
        # Whichever sees the death first fails the engine: the watchdog ("rank 1 exited") or rank 0's
        # collective in the step in flight (gloo's connection error); either way the request ends here.
        assert frames[-1].finish_reason == "error" and frames[-1].error
        assert sum(len(f.token_ids) for f in frames) < 980
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine failed" in health.json()["error"]["message"]
        assert post(url, GenerateRequest("after", [5, 6], SamplingParams(max_tokens=2)).pack()).status_code == 503
        print(f"dead rank: request ended with an error, health red, {time.time() - start:.1f} s after the request")
        assert time.time() - start < 60
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not rank0.is_running() or rank0.status() == psutil.STATUS_ZOMBIE


def spawned_children(pid: int) -> list[psutil.Process]:
    """The processes ``pid`` spawned through multiprocessing (not its resource tracker)."""
    return [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


class _FaultyRunner(ModelRunner):
    """Raises in any step that runs request "boom", as a failing device or a lost rank would."""

    def launch(self, scheduled, previous=None):
        if any(seq.request_id == "boom" for seq, _ in scheduled):
            raise RuntimeError("device fault")
        return super().launch(scheduled, previous)


def _faulty_core(config: EngineConfig) -> EngineCore:
    model, model_config = peaky_tiny()
    return EngineCore(config, _FaultyRunner(model, model_config, torch.device("cpu"), torch.float32, 16, 8, 1024))


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "thread"])
def test_a_step_that_raises_fails_the_engine_and_ends_its_requests(engine_process):
    config = EngineConfig(model="tiny", num_kv_blocks=64)
    app = build_app(config, make_core=functools.partial(_faulty_core, config), engine_process=engine_process)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while (health := client.get("/health")).status_code != 200:  # the engine thread warms up
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)

        def generate(rid: str, n: int = 1):
            request = GenerateRequest(rid, [10, 11, 12], SamplingParams(max_tokens=4, n=n, temperature=0.0))
            return client.post("/generate", content=request.pack(), headers={"content-type": MSGPACK})

        assert generate("fine").status_code == 200
        resp = generate("boom", n=2)
        unpacker = msgpack.Unpacker(strict_map_key=False)
        unpacker.feed(resp.content)
        ends = {f.index: f for f in map(OutputFrame.from_wire, unpacker) if f.finish_reason}
        assert sorted(ends) == [0, 1]
        assert all(f.finish_reason == "error" and f.error == "engine failed: device fault" for f in ends.values())
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "engine failed: device fault"
        assert generate("after").status_code == 503
