"""Warmup: every first-call cost (CUDA graph capture, kernel compiles) paid before the first request."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import structlog

from engine.core import EngineCore, EngineCounters
from engine.protocol import GenerateRequest, SamplingParams, StructuredOutput

log = structlog.get_logger("engine")

WARMUP_SALT = "kvgate-warmup"
_WARMUP_DECODES = 4


def warmup(core: EngineCore) -> None:
    """Capture the decode CUDA graphs (and with --cuda-graph-prefill-tokens the prefill steps' pieces),
    then run through the whole engine a prefill of each power-of-two length up to a full chunk (one
    short prefill on the CPU, which compiles nothing), and decode steps that admit a prefill (mixed
    batches) at a short and (on CUDA, for split-K) a long context with a sampled request (penalties,
    top-k/p, logprobs), at the short one a request sampled at a temperature alone (the sampling
    kernel's noise) and, when the model has a vocabulary, a constrained one, so that every kernel
    variant is compiled and loaded. Leaves the core idle with fresh counters."""
    start = time.perf_counter()
    graph_bytes = 0
    buckets: list[int] = []
    if _use_cuda_graphs(core):
        graph_bytes = core.runner.capture_decode_graphs()
        buckets = core.runner.decode_graphs.buckets
        prefill_tokens = min(core.config.cuda_graph_prefill_tokens, core.config.max_num_batched_tokens)
        if prefill_tokens >= 16 and core.config.tensor_parallel_size == 1:  # a rank's forward is not piecewise
            graph_bytes += core.runner.capture_prefill_graphs(prefill_tokens)
    cuda = core.device.type == "cuda"
    # Two warmup sequences run at once; each may take half of the pool.
    limit = max(1, min(core.max_model_len, core.kv.num_blocks * core.kv.block_size // 2) - _WARMUP_DECODES)
    chunk = min(core.config.max_num_batched_tokens, limit) if cuda else min(limit, 64)
    prompts = itertools.count()
    for length in [2**k for k in range(4, chunk.bit_length()) if cuda and 2**k < chunk] + [chunk]:
        _warmup_run(core, prompts, [length])
    _warmup_run(core, prompts, [min(8, limit)] * 3)  # one block: a single split
    if cuda:  # split-K decode (the CPU's attention has no split variant to compile)
        _warmup_run(core, prompts, [min(300, limit), min(200, limit)])
    if core.grammars is not None:  # the mask's thread pool and its kernel, off the first constrained request
        _warmup_run(core, prompts, [min(8, limit), min(8, limit)], StructuredOutput("json_object"))
    core.counters = EngineCounters()
    log.info(
        "warmup_done",
        seconds=round(time.perf_counter() - start, 2),
        cuda_graph_buckets=buckets,
        cuda_graph_prefill_buckets=len(core.runner.prefill_graphs.buckets) if core.runner.prefill_graphs else 0,
        cuda_graph_memory_mib=round(graph_bytes / 2**20, 1),
    )


def _use_cuda_graphs(core: EngineCore) -> bool:
    if core.device.type != "cuda" or core.config.enforce_eager:
        return False
    if core.config.resolved_kernel_backend != "triton":
        # The torch reference ops synchronize with the host, which a capture forbids.
        log.warning("cuda_graphs_disabled", reason="kernel_backend torch")
        return False
    return True


def _warmup_run(core: EngineCore, prompts: Iterator[int], lengths: list[int],
                structured: StructuredOutput | None = None) -> None:
    """Run warmup requests of the given prompt lengths to completion; each request after the
    first is added once the one before it decodes, so its prefill shares a decode step. The first
    is greedy, the second sampled with every processor (constrained by ``structured``, if given),
    a third at a temperature alone."""
    vocab = core.model_config.vocab_size
    for i, length in enumerate(lengths):
        first = next(prompts) * 7919  # distinct prompts: no prefix hits among warmup requests
        if i == 1:
            sampling = SamplingParams(
                max_tokens=_WARMUP_DECODES, temperature=0.8, top_p=0.9, top_k=40, min_p=0.01, presence_penalty=0.1,
                frequency_penalty=0.1, repetition_penalty=1.1, seed=0, logprobs=2, ignore_eos=True,
                structured=structured,
            )
        else:
            sampling = SamplingParams(max_tokens=_WARMUP_DECODES, temperature=0.0 if i == 0 else 0.7, ignore_eos=True)
        request = GenerateRequest(
            request_id=f"kvgate-warmup-{first}",
            prompt_ids=[(first + j) % vocab for j in range(length)],
            sampling=sampling,
            salt=WARMUP_SALT,
        )
        core.add_request(request)
        seq = core.requests[request.request_id][0]
        while not seq.output_ids:
            core.step()
    while core.has_work():
        core.step()
