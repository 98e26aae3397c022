"""EngineCore: one loop, three verbs — schedule → run → postprocess. Not thread-safe."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog
import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import BlockCounts, KVCacheManager
from engine.model_runner import ModelRunner, SampledToken, kv_bytes_per_block
from engine.protocol import EngineStats, GenerateRequest, ModelLimits, OutputFrame, ProtocolError, SamplingParams
from engine.request import Sequence, Status
from engine.scheduler import Scheduler
from kernels import load_ops

log = structlog.get_logger("engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_SALT = "kvgate-warmup"
_WARMUP_DECODES = 4
CPU_KV_CACHE_GB = 1.0


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    return _DTYPES[config.dtype]


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (not served from cache)
    generation_tokens: int = 0
    requests_finished: int = 0
    busy_seconds: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
        )
        self.runner = ModelRunner(
            model, model_config, self.device, self.dtype, config.block_size, config.max_num_seqs,
            self.max_model_len,
        )
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, record_events=config.index_url is not None,
            max_partial_entries=int(num_blocks * config.max_partial_entries_fraction),
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.resolved_prefill_pack_tokens)
        self.limits = ModelLimits(model_config.vocab_size, self.max_model_len)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self._held_siblings: dict[str, list[Sequence]] = {}  # n > 1: admitted once seq 0 has prefilled
        self.counters = EngineCounters()
        log.info(
            "kv_cache_ready",
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_tokens=num_blocks * config.block_size,
            kv_gib=round(num_blocks * kv_bytes_per_block(model_config, config.block_size, self.dtype) / 2**30, 3),
            max_model_len=self.max_model_len,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        from engine.models.loader import load_model

        torch.manual_seed(config.seed)
        model, model_config = load_model(
            config.model, config.load_format, torch.device(config.device), resolve_dtype(config),
            load_ops(config.resolved_kernel_backend),
        )
        return cls(config, model, model_config)

    def _num_kv_blocks(self) -> int:
        """--num-kv-blocks, else --kv-cache-memory, else on CUDA what --gpu-memory-utilization
        leaves after a profiling run of the largest step, else (CPU) 1 GiB."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        if config.kv_cache_memory_gb is not None or self.device.type != "cuda":
            return int((config.kv_cache_memory_gb or CPU_KV_CACHE_GB) * 2**30 // per_block)
        profile = self.runner.profile_memory(config.max_num_batched_tokens, config.gpu_memory_utilization)
        gib = 2**30
        log.info(
            "memory_profiled",
            gpu_memory_utilization=config.gpu_memory_utilization,
            total_gib=round(profile.total / gib, 2),
            in_use_gib=round(profile.in_use / gib, 2),
            peak_activation_gib=round(profile.peak_activation / gib, 3),
            kv_budget_gib=round(profile.kv_budget / gib, 2),
        )
        num_blocks = profile.kv_budget // per_block
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                f"{max(profile.kv_budget, 0) / gib:.2f} GiB for the KV cache, less than one "
                f"{self.max_model_len}-token sequence needs; raise it or lower max_model_len"
            )
        return num_blocks

    # --- requests ------------------------------------------------------------------------
    def check_admissible(self, request: GenerateRequest) -> None:
        """Raise ProtocolError if ``request`` can never run here. Reads only immutable state."""
        total = len(request.prompt_ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ProtocolError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.sampling.max_tokens}) "
                f"exceeds the model's context length of {self.max_model_len} tokens",
                "max_tokens",
            )
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise ProtocolError(
                f"prompt + max_tokens ({total} tokens) needs more KV cache than this engine has "
                f"({self.kv.num_blocks * self.kv.block_size} tokens)",
                "max_tokens",
            )

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a validated request; raises ProtocolError if it can never run here."""
        rid = request.request_id
        if rid in self.requests:
            raise ProtocolError(f"request_id {rid!r} is already running", "request_id")
        self.check_admissible(request)
        sampling = request.sampling
        seqs = [
            Sequence(
                rid, i, request.prompt_ids, sampling, request.salt, request.cache_boundaries,
                self._generator(sampling, i),
            )
            for i in range(sampling.n)
        ]
        self.requests[rid] = seqs
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            self._held_siblings[rid] = seqs[1:]

    def abort(self, request_id: str) -> list[OutputFrame]:
        """Finish every unfinished sequence of the request with reason "abort"; frees blocks."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return []
        held = self._held_siblings.pop(request_id, [])
        frames = []
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                if seq not in held:
                    self.scheduler.finish(seq, "abort")
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                frames.append(self._frame(seq))
        return frames

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[OutputFrame]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self._copy_blocks()  # prefix hits resume on private copies of exact-position entries
        sampled = self.runner.execute(sched.scheduled)
        frames = self._postprocess(sched.scheduled, sampled)
        self._copy_blocks()  # new entries, while their source pages still hold this step's KV
        self.counters.steps += 1
        self.counters.busy_seconds += time.perf_counter() - t0
        return frames

    def _copy_blocks(self) -> None:
        copies = self.kv.take_block_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def _postprocess(self, scheduled, sampled: list[SampledToken]) -> list[OutputFrame]:
        for seq, num_new in scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.counters.prompt_tokens += min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            self.kv.cache_computed_blocks(seq)
            siblings = self._held_siblings.get(seq.request_id)
            if siblings and seq.index == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                for sibling in self._held_siblings.pop(seq.request_id):
                    self.scheduler.add(sibling)
        frames = []
        for seq, token_id, logprob in sampled:
            seq.append_token(token_id)
            if logprob is not None:
                seq.pending_logprobs.append(logprob)
            self.counters.generation_tokens += 1
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            frames.append(self._frame(seq))
            if reason is not None:
                self._retire(seq)
        return frames

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.sampling
        num_out = len(seq.output_ids)
        if num_out >= p.min_tokens and (
            token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids)
        ):
            return "stop"
        if num_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _retire(self, seq: Sequence) -> None:
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.status is Status.FINISHED for s in seqs):
            del self.requests[seq.request_id]
            self.counters.requests_finished += 1

    def _frame(self, seq: Sequence) -> OutputFrame:
        new_tokens = seq.output_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = len(seq.output_ids)
        logprobs = None
        if seq.sampling.logprobs is not None:
            logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        return OutputFrame(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=new_tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _generator(self, sampling: SamplingParams, index: int) -> torch.Generator | None:
        if sampling.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed((sampling.seed + index) % 2**64)
        return generator

    # --- introspection -------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for seqs in self.requests.values() for s in seqs if s.status is not Status.FINISHED]

    def check_integrity(self) -> BlockCounts:
        return self.kv.check_integrity(self.live_sequences())

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            model=self.model_config.name,
            replica_id=self.config.replica_id,
            block_size=kv.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(map(len, self._held_siblings.values())),
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=round(kv.usage, 4),
            prefix_hit_rate=round(kv.prefix_hit_rate, 4),
            num_partial_entries=len(kv.partial),
            num_preemptions=self.scheduler.num_preemptions,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            prefill_pack_tokens=self.scheduler.prefill_pack_tokens,
            max_num_seqs=self.config.max_num_seqs,
            total_busy_seconds=self.counters.busy_seconds,
        )

    def warmup(self) -> None:
        """Pay every first-call cost before the first request: capture the decode CUDA graphs,
        then run through the whole engine a prefill of each power-of-two length up to a full
        chunk (one short prefill on the CPU, which compiles nothing), and decode steps that admit
        a prefill (mixed batches) at a short and a long context with a sampled request (penalties,
        top-k/p, logprobs), so that every kernel variant is compiled and loaded."""
        start = time.perf_counter()
        graph_bytes = 0
        buckets: list[int] = []
        if self._use_cuda_graphs():
            graph_bytes = self.runner.capture_decode_graphs()
            buckets = self.runner.decode_graphs.buckets
        cuda = self.device.type == "cuda"
        # Two warmup sequences run at once; each may take half of the pool.
        limit = max(1, min(self.max_model_len, self.kv.num_blocks * self.kv.block_size // 2) - _WARMUP_DECODES)
        chunk = min(self.config.max_num_batched_tokens, limit) if cuda else min(limit, 64)
        prompts = itertools.count()
        for length in [2**k for k in range(4, chunk.bit_length()) if cuda and 2**k < chunk] + [chunk]:
            self._warmup_run(prompts, [length])
        self._warmup_run(prompts, [min(8, limit), min(8, limit)])  # one block: a single split
        self._warmup_run(prompts, [min(300, limit), min(200, limit)])  # split-K decode
        self.counters = EngineCounters()
        log.info(
            "warmup_done",
            seconds=round(time.perf_counter() - start, 2),
            cuda_graph_buckets=buckets,
            cuda_graph_memory_mib=round(graph_bytes / 2**20, 1),
        )

    def _use_cuda_graphs(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if self.config.resolved_kernel_backend != "triton":
            # The torch reference ops synchronize with the host, which a capture forbids.
            log.warning("cuda_graphs_disabled", reason="kernel_backend torch")
            return False
        return True

    def _warmup_run(self, prompts: Iterator[int], lengths: list[int]) -> None:
        """Run warmup requests of the given prompt lengths to completion; each request after the
        first is added once the one before it decodes, so its prefill shares a decode step."""
        vocab = self.model_config.vocab_size
        for i, length in enumerate(lengths):
            first = next(prompts) * 7919  # distinct prompts: no prefix hits among warmup requests
            sampled = i > 0
            request = GenerateRequest(
                request_id=f"kvgate-warmup-{first}",
                prompt_ids=[(first + j) % vocab for j in range(length)],
                sampling=SamplingParams(
                    max_tokens=_WARMUP_DECODES, temperature=0.8 if sampled else 0.0, top_p=0.9, top_k=40,
                    min_p=0.01, presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
                    seed=0 if sampled else None, logprobs=2 if sampled else None, ignore_eos=True,
                ),
                salt=WARMUP_SALT,
            )
            self.add_request(request)
            seq = self.requests[request.request_id][0]
            while not seq.output_ids:
                self.step()
        while self.has_work():
            self.step()
