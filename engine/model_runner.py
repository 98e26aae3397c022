"""Scheduled sequences → tensors → model → sampler. Owns the KV tensors and the decode CUDA graphs."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.cpu import lazy_zeros
from engine.cuda_graphs import CarriedTokens, DecodeGraphs, decode_buckets
from engine.kv_groups import group_tables, kv_layout
from engine.kv_host import HostKVStore, HostTransfers
from engine.prefill_graphs import PrefillGraphs, prefill_buckets
from engine.prompt_logprobs import collect_prompt_logprobs
from engine.protocol import SamplingParams, TokenLogprob
from engine.request import Sequence
from engine.sampler import Sampler
from engine.scheduler import SampledToken, ScheduledSeq
from engine.spec_decode import verify
from engine.transfer import to_device


class MemoryProfile(NamedTuple):
    """What a profiling run found on the device, in bytes."""

    total: int
    in_use: int  # after the profiling run: weights, CUDA context, other processes
    peak_activation: int  # the largest step's transient tensors
    kv_budget: int  # what gpu_memory_utilization leaves for the KV cache


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page of the pool: a block of tokens for the layers of one group (all layers,
    without sliding windows; see engine.kv_groups)."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * kv_layout(config).group_size * block_size * config.num_kv_heads * config.head_dim * element


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class HostTokens(NamedTuple):
    buffer: torch.Tensor  # pinned int64
    copied: torch.cuda.Event


class StepClock:
    """How long a step held the device: on CUDA, events around its work (the stream's time from the
    end of the step before, or the step's first kernel if later, to its last: host time the stream
    waits for a launch counts, the step being that slow); on the CPU, which computes as it launches,
    the launch's wall time. Read once the step is done."""

    def __init__(self, device: torch.device):
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else None
        if self._events is not None:
            self._events[0].record()
        self._wall = [time.perf_counter()]

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._wall.append(time.perf_counter())

    def seconds(self) -> float:
        if self._events is None:
            return self._wall[1] - self._wall[0]
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


class LaunchedStep:
    """A step queued on the device (:meth:`ModelRunner.launch`): the sequences that sampled, their
    tokens on the device (``tokens``, which the next step may read) and on their way to the host.
    :meth:`resolve` waits for them there."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None, logprobs: list[TokenLogprob | None],
                 graphed: bool, host: HostTokens | None = None, clock: StepClock | None = None):
        self.seqs = seqs
        self.tokens = tokens
        self.graphed = graphed  # replayed from a CUDA graph
        self.rows = {seq.key: i for i, seq in enumerate(seqs)}
        self._logprobs = logprobs
        self._host = host
        self._clock = clock
        self._sampled: list[SampledToken] | None = None
        if tokens is not None and host is not None:
            host.buffer[: len(seqs)].copy_(tokens, non_blocking=True)
            host.copied.record()
        if clock is not None:
            clock.stop()

    @classmethod
    def on_host(cls, sampled: list[SampledToken], graphed: bool, clock: StepClock | None = None) -> LaunchedStep:
        """A step whose tokens are already on the host (verified drafts, or no token): it feeds no
        next step from the device."""
        step = cls([], None, [], graphed, clock=clock)
        step._sampled = sampled
        return step

    def seconds(self) -> float | None:
        """How long the step held the device (:class:`StepClock`), once resolved; None if unclocked."""
        return None if self._clock is None else self._clock.seconds()

    def resolve(self) -> list[SampledToken]:
        """The step's tokens, once on the host (waits for the device the first time)."""
        if self._sampled is None:
            if self._host is not None:
                self._host.copied.synchronize()
                token_ids = self._host.buffer[: len(self.seqs)].tolist()
            else:
                token_ids = self.tokens.tolist()
            self._sampled = [SampledToken(*row) for row in zip(self.seqs, token_ids, self._logprobs)]
        return self._sampled


def _carried(scheduled: list[ScheduledSeq], previous: LaunchedStep | None) -> CarriedTokens | None:
    """The rows of ``scheduled`` whose one new token is pending, and where ``previous`` holds it."""
    rows = [(i, previous.rows[seq.key]) for i, (seq, _) in enumerate(scheduled)
            if seq.num_pending_tokens] if previous is not None else []
    return CarriedTokens(previous.tokens, rows) if rows else None


class ModelRunner:
    """Not thread-safe: the engine loop alone calls it. ``allocate_kv_cache`` comes before
    ``execute``; ``capture_decode_graphs`` (CUDA only) after it, before serving."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        kv_dtype: torch.dtype | None = None,
        num_speculative_tokens: int = 0,
    ):
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the KV pool's (fp8: see engine.kv_quant)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # Graph replays use block tables of this full width, so one graph serves any context length.
        self.max_blocks_per_seq = _ceil_div(max_model_len, block_size)
        self.layout = kv_layout(config)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (groups share tensors)
        self.kv_pages: list[tuple[torch.Tensor, torch.Tensor]] = []  # the pool's group_size tensors
        self.host_kv: HostKVStore | None = None  # the host tier's pages (--host-kv-cache-gib)
        self.sampler = Sampler(config.eos_token_ids, model.ops)
        self.num_speculative_tokens = num_speculative_tokens  # 0: no speculation
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # decode steps with drafts: 1 + K queries per row
        self.prefill_graphs: PrefillGraphs | None = None  # steps with prompt tokens, in pieces
        self._token_buffers: list[HostTokens] = []

    def _new_kv_pages(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        if self.device.type == "cpu":  # resident only once written: the pool's size costs nothing idle
            return [tuple(lazy_zeros(shape, self.kv_dtype) for _ in "kv") for _ in range(self.layout.group_size)]
        return [
            tuple(torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in "kv")
            for _ in range(self.layout.group_size)
        ]

    def _per_layer(self, pages: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [pages[slot] for slot in self.layout.layer_slot]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_pages = self._new_kv_pages(num_blocks)
        self.kv_caches = self._per_layer(self.kv_pages)

    def allocate_host_kv_cache(self, num_slots: int) -> None:
        """Host pages for ``num_slots`` pool pages (after :meth:`allocate_kv_cache`)."""
        self.host_kv = HostKVStore(self.kv_pages, num_slots)

    def move_host_blocks(self, transfers: HostTransfers) -> None:
        """Queue the host tier's copies (see :meth:`HostKVStore.run`; no sync on CUDA)."""
        assert self.host_kv is not None, "allocate_host_kv_cache first"
        self.host_kv.run(transfers)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV pages ``src -> dst`` in every layer, queued on the device (no sync): all
        sources are gathered before any destination is written."""
        src, dst = torch.tensor(list(zip(*pairs)), dtype=torch.int64).to(self.device, non_blocking=True)
        for cache in self.kv_pages:
            for layer in cache:
                raw = layer.view(torch.uint8) if layer.element_size() == 1 else layer  # no fp8 index_copy_
                raw.index_copy_(0, dst, raw.index_select(0, src))

    # --- memory profiling (CUDA) ---------------------------------------------------------------
    @torch.inference_mode()
    def profile_memory(self, num_tokens: int, gpu_memory_utilization: float) -> MemoryProfile:
        """Run the largest step this engine will ever run — ``num_tokens`` prompt tokens, then
        logits and random sampling with logprobs for ``max_num_seqs`` rows — on a scratch KV
        cache, and return how much of ``gpu_memory_utilization`` of the device is left for KV."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)

        max_len = self.max_blocks_per_seq * self.block_size
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        # every layer group reads the same tables: a scratch cache sized for one
        kv_caches = self._per_layer(self._new_kv_pages(sum(_ceil_div(n, self.block_size) for n in lens)))
        tables = np.zeros((len(lens), max(_ceil_div(n, self.block_size) for n in lens)), dtype=np.int32)
        slots, positions, first = [], [], 0
        for i, n in enumerate(lens):
            blocks = list(range(first, first + _ceil_div(n, self.block_size)))
            tables[i, : len(blocks)] = blocks
            first += len(blocks)
            positions.extend(range(n))
            slots.extend(blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(n))
        starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        dev = self.device
        attn = self._metadata(tables, lens, starts, slots, max(lens))
        input_ids = torch.randint(self.config.vocab_size, (num_tokens,), device=dev)
        hidden = self.model(input_ids, torch.tensor(positions, device=dev), attn, kv_caches)
        rows = min(self.max_num_seqs * (1 + self.num_speculative_tokens), num_tokens)  # verification: 1 + K each
        sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5, frequency_penalty=0.1)
        seqs = [SimpleNamespace(sampling=sampling, prompt_ids=[0], output_ids=[1], generator=None, matcher=None)] * rows
        self.sampler(self.model.compute_logits(hidden[-rows:]), seqs)
        torch.cuda.synchronize(self.device)
        peak_activation = torch.cuda.max_memory_allocated(self.device) - before

        del kv_caches, hidden, attn
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        kv_budget = int(total * gpu_memory_utilization) - in_use - peak_activation
        return MemoryProfile(total, in_use, peak_activation, kv_budget)

    # --- CUDA graphs -----------------------------------------------------------------------------
    def capture_decode_graphs(self) -> int:
        """Capture the decode-only step at every batch bucket up to ``max_num_seqs`` (KV cache
        allocated first), and with speculation the verification step of ``1 + K`` queries per row;
        returns the bytes the graphs and their static buffers hold."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, self.device, self.block_size, self.max_blocks_per_seq,
            decode_buckets(self.max_num_seqs), capture=True, num_groups=len(self.layout.group_windows),
        )
        with torch.inference_mode():
            graph_bytes = self.decode_graphs.capture()
            if self.num_speculative_tokens:
                self.verify_graphs = DecodeGraphs(
                    self.model, self.kv_caches, self.device, self.block_size, self.max_blocks_per_seq,
                    decode_buckets(self.max_num_seqs), capture=True, query_len=1 + self.num_speculative_tokens,
                )
                graph_bytes += self.verify_graphs.capture()
        return graph_bytes

    def capture_prefill_graphs(self, max_tokens: int) -> int:
        """Capture the steps with prompt tokens, up to ``max_tokens``, in pieces broken at each layer's
        attention (KV cache allocated first); returns the bytes the graphs and their buffers hold."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.device, prefill_buckets(max_tokens),
                                            len(self.layout.group_windows), capture=True)
        with torch.inference_mode():
            self.prefill_graphs.capture()
        return free_before - torch.cuda.mem_get_info(self.device)[0]

    # --- one step --------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledSeq]) -> list[SampledToken]:
        """Run one step and wait for its tokens (:meth:`launch`, then resolve)."""
        return self.launch(scheduled).resolve()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device; sample for every sequence whose tokens are then all
        computed (and verify the drafts of those that have one). Waits for the device only where
        the host needs a value (logprobs, prompt logprobs, drafts). A sequence whose token is still
        pending (``num_pending_tokens``: overlapped scheduling) reads it from ``previous``'s tokens on
        the device. The prefill chunks of sequences that need prompt logprobs get them here (never in
        a decode graph)."""
        clock = StepClock(self.device)
        if any(seq.draft_ids for seq, _ in scheduled) and self._verifies_in_graph(scheduled):
            seqs = [seq for seq, _ in scheduled]
            q = self.verify_graphs.query_len
            logits = self.verify_graphs.run(seqs).logits
            rows = [i * q + j for i, seq in enumerate(seqs) for j in range(1 + len(seq.draft_ids))]
            rows = to_device(rows, torch.int64, self.device)
            return LaunchedStep.on_host(self._verified(logits[rows], seqs), True, clock)
        carried = _carried(scheduled, previous)
        graphs = self.decode_graphs
        prompt_logprobs = any(seq.needs_prompt_logprobs for seq, _ in scheduled)
        graphed = (graphs is not None and not prompt_logprobs and len(scheduled) <= graphs.max_batch_size
                   and all(n == 1 for _, n in scheduled))
        if graphed:
            seqs = [seq for seq, _ in scheduled]
            sample_rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens]
            sampling_seqs = [seqs[i] for i in sample_rows]
            # Every row samples straight from its raw logits: the graph's own draw is the answer.
            draw = self.sampler.direct_draw(seqs) if len(sample_rows) == len(seqs) else None
            logits, tokens = graphs.run(seqs, carried, draw)
            if not sample_rows:
                return LaunchedStep.on_host([], graphed, clock)
            if draw is not None:
                return LaunchedStep(seqs, tokens, [None] * len(seqs), graphed, self._host_tokens(), clock)
            if len(sample_rows) < logits.shape[0]:
                logits = logits[to_device(sample_rows, torch.int64, self.device)]
        else:
            hidden, sample_rows, sampling_seqs = self._run_eager(scheduled, carried)
            if prompt_logprobs:
                collect_prompt_logprobs(self.model.compute_logits, hidden, scheduled)
            if not sample_rows:
                return LaunchedStep.on_host([], graphed, clock)
            if len(sample_rows) < hidden.shape[0]:
                hidden = hidden[to_device(sample_rows, torch.int64, self.device)]
            logits = self.model.compute_logits(hidden)
            if any(seq.draft_ids for seq in sampling_seqs):
                return LaunchedStep.on_host(self._verified(logits, sampling_seqs), graphed, clock)
        tokens, logprobs = self.sampler.sample(logits, sampling_seqs)
        return LaunchedStep(sampling_seqs, tokens, logprobs, graphed, self._host_tokens(), clock)

    def _host_tokens(self) -> HostTokens | None:
        """The pinned buffer and event a step's tokens come back through (CUDA; two in turn: one
        step's are read while the next one's are on their way)."""
        if self.device.type != "cuda":
            return None
        if not self._token_buffers:
            rows = self.max_num_seqs * (1 + self.num_speculative_tokens)
            self._token_buffers = [HostTokens(torch.empty(rows, dtype=torch.int64, pin_memory=True),
                                              torch.cuda.Event()) for _ in range(2)]
        self._token_buffers.reverse()
        return self._token_buffers[0]

    def _verifies_in_graph(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the verification graphs run this step: every sequence decodes (its last token,
        and its draft if any) and fits them."""
        graphs = self.verify_graphs
        return graphs is not None and all(
            n == 1 + len(seq.draft_ids) and seq.num_computed_tokens + 1 == seq.num_tokens for seq, n in scheduled
        ) and graphs.fits([seq for seq, _ in scheduled])

    def _verified(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        return [SampledToken(seq, t.token_id, t.logprob)
                for seq, tokens in zip(seqs, verify(self.sampler, logits.float(), seqs)) for t in tokens]

    def _metadata(
        self, block_tables: np.ndarray, seq_lens: list[int], query_start: list[int], slots: list[int],
        max_query_len: int,
    ) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            block_tables=to_device(block_tables, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            query_start_loc=to_device(query_start, torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )

    def _group_metadata(
        self, scheduled: list[ScheduledSeq], seq_lens: list[int], query_start: list[int], max_query_len: int
    ) -> AttentionMetadata:
        """Group 0's metadata, holding every group's (block tables and slots of its own blocks)."""
        bs = self.block_size
        groups = []
        for group in range(len(self.layout.group_windows)):
            tables = [group_tables(seq)[group] for seq, _ in scheduled]
            block_tables = np.zeros((len(scheduled), max(map(len, tables))), dtype=np.int32)
            slots: list[int] = []
            for i, ((seq, num_new), table) in enumerate(zip(scheduled, tables)):
                block_tables[i, : len(table)] = table
                start = seq.num_computed_tokens
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + num_new))
            groups.append(self._metadata(block_tables, seq_lens, query_start, slots, max_query_len))
        if len(groups) == 1:
            return groups[0]
        groups[0].groups = tuple(groups)
        return groups[0]

    def _run_eager(
        self, scheduled: list[ScheduledSeq], carried: CarriedTokens | None = None
    ) -> tuple[torch.Tensor, list[int], list[Sequence]]:
        """A varlen batch of any mix of prefills and decodes: hidden states of every new token,
        the rows to sample (the last token of each sequence that is now fully computed, and each
        of its draft tokens) and their sequences. ``carried``: the sequences (by row of
        ``scheduled``) whose one new token is still on the device."""
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            drafts = seq.draft_ids  # scheduled whole after the sequence's last token
            known = seq.all_token_ids[start : end - len(drafts)]
            input_ids.extend(known)
            input_ids.extend([0] * (end - len(drafts) - start - len(known)))  # a pending token: carried
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            seq_lens.append(end)
            query_start.append(query_start[-1] + num_new)
            if end == seq.num_tokens + len(drafts):
                sample_rows.extend(range(query_start[-1] - 1 - len(drafts), query_start[-1]))
                sampling_seqs.append(seq)

        dev = self.device
        attn = self._group_metadata(scheduled, seq_lens, query_start, max(n for _, n in scheduled))
        ids = to_device(input_ids, torch.int64, dev)
        if carried is not None:  # a decode row's one token is the last of its row
            rows = [(query_start[i + 1] - 1, src) for i, src in carried.rows]
            dst, src = to_device(rows, torch.int64, dev).unbind(1)
            CarriedTokens(carried.tokens, rows).scatter(ids, dst, src)
        positions = to_device(positions, torch.int64, dev)
        if self.prefill_graphs is not None and self.prefill_graphs.fits(len(input_ids)):
            hidden = self.prefill_graphs.run(ids, positions, attn)
        else:
            hidden = self.model(ids, positions, attn, self.kv_caches)
        return hidden, sample_rows, sampling_seqs
