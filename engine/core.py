"""EngineCore: one loop, three verbs: schedule → run → update (the scheduler records the step).

With overlapped (asynchronous) scheduling the verbs of two steps interleave: step N+1 is planned
and queued on the device while step N still runs there, and then N's tokens are read and
recorded. The scheduler plans N+1 from N's advanced state (each sequence that sampled in N goes on
by one pending token, which N+1 reads on the device), and ``Scheduler.record`` masks N+1's result
for a sequence N finished or an abort ended. A step is left in flight only when the next one can
be planned without its tokens: no grammar (a mask needs the matcher advanced by the previous
token), no penalty or min_tokens (they count the output), no speculation (the proposer drafts from
the tokens); otherwise it is recorded before the next one is planned, as in the synchronous loop.

The core owns the requests by id and turns each step's sequences into frames; the model runner is
injected (:class:`Runner`), so its bookkeeping runs without a model in tests. So are the grammars
of structured output (:class:`engine.structured.Grammars`, None when the model has no vocabulary).
Not thread-safe, except :meth:`EngineCore.check_admissible` and :meth:`EngineCore.compile_structured`.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from engine.config import CPU_KV_CACHE_GB, EngineConfig, ModelConfig
from engine.cpu import ThreadGovernor, workers_spin
from engine.kv_cache import BlockCounts, KVCacheManager
from engine.kv_groups import HybridKVCacheManager, kv_layout
from engine.kv_host import HostBlockPool, HostKVStore, HostTransfers
from engine.kv_quant import FP8_KV, calibrate_kv_scales, kv_cache_dtype
from engine.mixed_budget import MixedPrefillBudget
from engine.model_runner import LaunchedStep, MemoryProfile, ModelRunner, kv_bytes_per_block
from engine.models.cpu import cpu_matmuls
from engine.models.fp8 import is_fp8, is_fp8_lm_head, quantize_fp8, quantize_lm_head
from engine.protocol import (
    EngineStats,
    GenerateRequest,
    ModelLimits,
    OutputFrame,
    ProtocolError,
    SamplingParams,
    StructuredOutput,
    check_fits,
)
from engine.request import Sequence, Status
from engine.scheduler import ScheduledSeq, Scheduler
from engine.spec_decode import NgramProposer
from engine.structured import NO_VOCABULARY, Grammars, new_matcher
from kernels import load_ops
from prefix_index.events import KVEvent
from prefix_index.hashing import BlockHash

if TYPE_CHECKING:
    import xgrammar

log = structlog.get_logger("engine")


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    return getattr(torch, config.dtype)


def context_limit(config: EngineConfig, model_config: ModelConfig) -> int:
    """--max-model-len, capped by the model's context length."""
    return min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    busy_seconds: float = 0.0
    computed_tokens: int = 0


class Runner(Protocol):
    """What the core needs of a model runner (:class:`engine.model_runner.ModelRunner`)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int

    def allocate_kv_cache(self, num_blocks: int) -> None: ...
    def profile_memory(self, num_tokens: int, gpu_memory_utilization: float) -> MemoryProfile: ...
    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None) -> LaunchedStep: ...
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...
    def allocate_host_kv_cache(self, num_slots: int) -> None: ...
    def move_host_blocks(self, transfers: HostTransfers) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, grammars: Grammars | None = None):
        self.config = config
        self.runner = runner
        self.grammars = grammars
        self.model_config = model_config = runner.config
        self.device, self.dtype, self.max_model_len = runner.device, runner.dtype, runner.max_model_len
        self.kv_dtype = kv_cache_dtype(config, self.dtype)
        num_blocks = self._num_kv_blocks()
        runner.allocate_kv_cache(num_blocks)
        layout = kv_layout(model_config)
        if config.speculative is not None and layout.hybrid:
            # Rolling back rejected drafts is implemented for the single-group pool only.
            raise ValueError(f"--speculative does not support {model_config.name}'s sliding-window layers yet")
        record_events = config.index_url is not None
        per_block = kv_bytes_per_block(model_config, config.block_size, self.kv_dtype)
        host = None
        if config.host_kv_cache_gib:
            num_slots = HostKVStore.slots_for(config.host_kv_cache_gib, per_block)
            if num_slots == 0:
                raise ValueError(f"host_kv_cache_gib {config.host_kv_cache_gib} holds no KV block of "
                                 f"{per_block} bytes; raise it or set 0")
            runner.allocate_host_kv_cache(num_slots)
            host = HostBlockPool(num_slots, record_events)
            log.info("host_kv_cache_ready", num_blocks=num_slots, kv_tokens=num_slots * config.block_size,
                     host_kv_gib=round(num_slots * per_block / 2**30, 3), pinned=self.device.type == "cuda")
        # Sliding-window layers: layer groups that free what leaves their window (engine.kv_groups).
        # an entry holds a page in every group: the fraction of the pool bounds their blocks
        max_entries = int(num_blocks * config.max_entries_fraction) // len(layout.group_windows)
        self.kv: KVCacheManager | HybridKVCacheManager = (
            HybridKVCacheManager(num_blocks, config.block_size, layout, config.enable_prefix_caching, record_events,
                                 max_entries, host)
            if layout.hybrid else
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, record_events, max_entries,
                           host=host)
        )
        self.proposer = None if config.speculative is None else NgramProposer(
            config.num_speculative_tokens, config.ngram_min, config.ngram_max
        )
        target_ms = config.mixed_prefill_step_latency_ms
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.resolved_prefill_pack_tokens,
            eos_token_ids=model_config.eos_token_ids, max_model_len=self.max_model_len, proposer=self.proposer,
            mixed_budget=MixedPrefillBudget(target_ms / 1e3, config.max_num_batched_tokens) if target_ms else None,
        )
        self.async_scheduling = config.resolved_async_scheduling
        self._in_flight: tuple[list[ScheduledSeq], LaunchedStep] | None = None  # step N, while N+1 is planned
        # the longest sequence the pool holds (a hybrid pool's window groups keep their window only)
        max_kv_tokens = bisect.bisect_right(range(self.max_model_len + 1), self.kv.num_blocks,
                                            key=self.kv.blocks_needed) - 1
        self.limits = ModelLimits(model_config.vocab_size, self.max_model_len, max_kv_tokens)
        self.requests: dict[str, list[Sequence]] = {}
        self._queued_at: dict[str, float] = {}  # requests not scheduled yet
        self._queue_times: list[float] = []  # seconds from arrival to first step, until taken
        self.counters = EngineCounters()
        # a CPU engine's spinning OpenMP workers leave the cores other processes keep busy
        # (a tensor-parallel rank's threads are set by its launcher)
        governed = (self.device.type == "cpu" and config.tensor_parallel_size == 1 and torch.get_num_threads() > 1
                    and workers_spin())
        self.thread_governor = ThreadGovernor(torch.get_num_threads()) if governed else None
        # KV bytes by group for a context of max_model_len tokens: a window group holds its window only
        self.kv_group_windows = layout.group_windows
        group_blocks = layout.group_blocks(self.max_model_len, config.block_size)
        self.kv_bytes_per_token_by_group = [round(n * per_block / self.max_model_len) for n in group_blocks]
        self.kv_tokens_per_gib = 2**30 * self.max_model_len // (sum(group_blocks) * per_block)
        log.info(
            "kv_cache_ready",
            num_blocks=num_blocks,
            block_size=config.block_size,
            kv_tokens=num_blocks * self.max_model_len // sum(group_blocks),  # of max_model_len-long contexts
            kv_gib=round(num_blocks * per_block / 2**30, 3),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_tokens_per_gib=self.kv_tokens_per_gib,
            kv_bytes_per_token_by_group=self.kv_bytes_per_token_by_group,
            max_model_len=self.max_model_len,
            kv_group_windows=list(self.kv_group_windows),  # a page holds a block of one group's layers
        )

    @classmethod
    def from_model(
        cls, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
        tokenizer_info: xgrammar.TokenizerInfo | None = None,
    ) -> EngineCore:
        device, dtype = torch.device(config.device), resolve_dtype(config)
        if config.quantization == "fp8" and not is_fp8(model):
            quantize_fp8(model)
            log.info("weights_quantized", quantization="fp8")
        if config.fp8_lm_head and not is_fp8_lm_head(model):
            quantize_lm_head(model)
            log.info("lm_head_quantized", quantization="fp8")
        if device.type == "cpu" and (path := cpu_matmuls(model, config.quantization, dtype)) is not None:
            log.info("cpu_matmuls", path=path)
        kv_dtype = kv_cache_dtype(config, dtype)
        if kv_dtype == FP8_KV:
            amax = calibrate_kv_scales(model, device, dtype)
            log.info("kv_scales_calibrated", layers=amax.shape[0], k_amax_max=round(float(amax[:, 0].max()), 3),
                     v_amax_max=round(float(amax[:, 1].max()), 3))
        runner = ModelRunner(
            model, model_config, device, dtype, config.block_size, config.max_num_seqs,
            context_limit(config, model_config), kv_dtype,
            config.num_speculative_tokens if config.speculative else 0,
        )
        return cls(config, runner, None if tokenizer_info is None else Grammars(tokenizer_info))

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        from engine.models.loader import load_model, load_tokenizer_info

        torch.manual_seed(config.seed)
        model, model_config = load_model(
            config.model, config.load_format, torch.device(config.device), resolve_dtype(config),
            load_ops(config.resolved_kernel_backend),
        )
        tokenizer_info = load_tokenizer_info(config.model, config.load_format, model_config)
        return cls.from_model(config, model, model_config, tokenizer_info)

    def _num_kv_blocks(self) -> int:
        """--num-kv-blocks, else --kv-cache-memory, else on CUDA what --gpu-memory-utilization
        leaves after a profiling run of the largest step, else (CPU) 1 GiB."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.kv_dtype)
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
        if num_blocks < sum(kv_layout(self.model_config).group_blocks(self.max_model_len, config.block_size)):
            raise ValueError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                f"{max(profile.kv_budget, 0) / gib:.2f} GiB for the KV cache, less than one "
                f"{self.max_model_len}-token sequence needs; raise it or lower max_model_len"
            )
        return num_blocks

    # --- requests ------------------------------------------------------------------------
    def check_admissible(self, request: GenerateRequest) -> None:
        """Raise ProtocolError if ``request`` can never run here. Reads only immutable state."""
        check_fits(self.limits, len(request.prompt_ids), request.sampling.max_tokens)

    def compile_structured(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Compile ``spec`` against the model's vocabulary (a cache hit once compiled); raises
        ProtocolError naming "structured" for a bad spec or a model without a vocabulary.
        Thread-safe: the sidecar compiles in a worker thread before it submits a request."""
        if self.grammars is None:
            raise ProtocolError(NO_VOCABULARY, "structured")
        return self.grammars.compile(spec)

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a validated request; raises ProtocolError if it can never run here. A structured
        request's grammar is compiled here unless it was before (then the compiler's cache has it)."""
        rid = request.request_id
        if rid in self.requests:
            raise ProtocolError(f"request_id {rid!r} is already running", "request_id")
        self.check_admissible(request)
        sampling = request.sampling
        grammar = None if sampling.structured is None else self.compile_structured(sampling.structured)
        # A constrained sequence's own matcher ends at EOS (even with ignore_eos) or a stop token.
        stops = (*self.model_config.eos_token_ids, *sampling.stop_token_ids)
        seqs = [
            Sequence(
                rid, i, request.prompt_ids, sampling, request.salt, request.cache_boundaries,
                self._generator(sampling, i), None if grammar is None else new_matcher(grammar, stops),
            )
            for i in range(sampling.n)
        ]
        self.requests[rid] = seqs
        self._queued_at[rid] = time.perf_counter()
        self.scheduler.add_request(seqs)

    def abort(self, request_id: str) -> list[OutputFrame]:
        """Finish every unfinished sequence of the request with reason "abort"; frees blocks."""
        seqs = self.requests.pop(request_id, None)
        self._queued_at.pop(request_id, None)
        if seqs is None:
            return []
        frames = []
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
                frames.append(self._frame(seq))
        return frames

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # --- the loop ------------------------------------------------------------------------
    def step(self) -> list[OutputFrame]:
        """Plan and queue a step, then record the step before it if that one is still in flight,
        then this one unless it may stay in flight; returns the frames of the steps recorded."""
        t0 = time.perf_counter()
        if self.thread_governor is not None:
            self.thread_governor.tick()
        scheduled = self.scheduler.schedule().scheduled  # the step in flight, if any, counts as done
        launched = None
        if scheduled:
            for seq, _ in scheduled:
                queued_at = self._queued_at.pop(seq.request_id, None)
                if queued_at is not None:
                    self._queue_times.append(t0 - queued_at)
            self._copy_blocks()  # host tier loads and offloads; prefix hits resume on copies of entries
            launched = self.runner.launch(scheduled, self._in_flight[1] if self._in_flight else None)
        frames = self._record(*self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        if launched is not None:
            self.scheduler.advance(scheduled)
            self._copy_blocks()  # new entries, queued after this step's KV is written
            if self.async_scheduling and not any(map(_needs_host_tokens, launched.seqs)) and self.proposer is None:
                self._in_flight = (scheduled, launched)
            else:
                frames += self._record(scheduled, launched)
            self.counters.steps += 1
            self.counters.computed_tokens += sum(s.num_new_tokens for s in scheduled)
        self.counters.busy_seconds += time.perf_counter() - t0
        return frames

    def _record(self, scheduled: list[ScheduledSeq], launched: LaunchedStep) -> list[OutputFrame]:
        """Wait for a step's tokens, have the scheduler record them, and turn them into frames."""
        sampled = launched.resolve()
        budget, seconds = self.scheduler.mixed_budget, launched.seconds()
        if budget is not None and seconds is not None:
            budget.observe(sum(n for _, n in scheduled), seconds, launched.graphed)
        outputs = self.scheduler.record(scheduled, sampled)
        self._copy_blocks()  # entries of finished sequences' last pages
        frames = [self._frame(seq) for seq in outputs]
        for seq in outputs:
            if seq.finish_reason is not None:
                self._retire(seq.request_id)
        return frames

    def take_queue_times(self) -> list[float]:
        """Each request's wait from arrival to the first step that ran it, since the last call."""
        times, self._queue_times = self._queue_times, []
        return times

    def _copy_blocks(self) -> None:
        transfers = self.kv.take_host_transfers()
        if transfers:
            self.runner.move_host_blocks(transfers)
        copies = self.kv.take_block_copies()
        if copies:
            self.runner.copy_blocks(copies)

    def _retire(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.status is Status.FINISHED for s in seqs):
            del self.requests[request_id]

    def _frame(self, seq: Sequence) -> OutputFrame:
        new_tokens = seq.output_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = len(seq.output_ids)
        logprobs = None
        if seq.sampling.logprobs is not None:
            logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        first = seq.index == 0 and new_tokens and seq.num_sent_tokens == len(new_tokens)
        prompt_logprobs = seq.prompt_logprobs if first and seq.sampling.prompt_logprobs is not None else None
        return OutputFrame(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=new_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
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
        """The KV pool's counts; raises IntegrityError if it or the host tier is inconsistent."""
        self.check_host_integrity()
        return self.kv.check_integrity(self.live_sequences())

    def check_host_integrity(self) -> BlockCounts | None:
        """The host tier's counts (None without one); raises IntegrityError if it is inconsistent."""
        return self.kv.host.check_integrity() if self.kv.host is not None else None

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.drain_events()

    def kv_snapshot(self) -> list[tuple[BlockHash, BlockHash | None]]:
        """Every cached block's (hash, parent); thread-safe (the KV event publisher calls it)."""
        return self.kv.snapshot()

    def host_kv_snapshot(self) -> list[BlockHash]:
        """The hashes the host tier holds (none without one); thread-safe, as :meth:`kv_snapshot`."""
        return self.kv.host.snapshot() if self.kv.host is not None else []

    def stats(self) -> EngineStats:
        kv, host = self.kv, self.kv.host
        spec = self.proposer.stats if self.proposer is not None else None
        return EngineStats(
            model=self.config.served_name,
            replica_id=self.config.replica_id,
            block_size=kv.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=round(kv.usage, 4),
            num_cached_blocks=kv.num_cached_blocks,
            prefix_hit_rate=round(kv.prefix_hit_rate, 4),
            num_position_entries=len(kv.entries),
            num_preemptions=self.scheduler.num_preemptions,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            prefill_pack_tokens=self.scheduler.prefill_pack_tokens,
            max_num_seqs=self.config.max_num_seqs,
            total_busy_seconds=self.counters.busy_seconds,
            num_waiting_tokens=sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                   for s in (*self.scheduler.waiting, *self.scheduler.running)),
            total_computed_tokens=self.counters.computed_tokens,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_tokens_per_gib=self.kv_tokens_per_gib,
            kv_group_windows=list(self.kv_group_windows),
            kv_bytes_per_token_by_group=self.kv_bytes_per_token_by_group,
            num_host_blocks=host.num_slots if host else 0,
            num_host_cached_blocks=host.num_cached_blocks if host else 0,
            host_offloaded_blocks=host.num_offloaded if host else 0,
            host_loaded_blocks=host.num_loaded if host else 0,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_num_accepted_tokens_per_pos=list(spec.accepted_per_pos) if spec else [],
            mixed_prefill_budget=(self.scheduler.mixed_budget.budget if self.scheduler.mixed_budget is not None
                                  else self.config.max_num_batched_tokens),
            cpu_threads=(0 if self.device.type != "cpu" else
                         self.thread_governor.threads if self.thread_governor is not None else torch.get_num_threads()),
        )


def _needs_host_tokens(seq: Sequence) -> bool:
    """Whether sampling ``seq``'s next token needs its last one on the host: a grammar mask (the
    matcher advances by it), penalties or a min_tokens mask (they read or count the output)."""
    p = seq.sampling
    return (seq.matcher is not None or len(seq.output_ids) < p.min_tokens or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
