"""Piecewise CUDA graphs of the steps with prompt tokens (prefill chunks, alone or beside decodes).

Eagerly, such a step is ~300 launches: 21-41 ms of host time on the H100's host for a SmolLM2 step
whose device work takes a few milliseconds, during which every decoding stream waits
(benchmarks/results/served_eager_h100.jsonl). But everything a step computes other than attention
depends on nothing but its token count, so per bucket of token counts the forward is captured in
pieces broken at each layer's paged attention: piece 0 runs from the input ids to the first layer's
attention inputs, piece ``i`` from layer ``i - 1``'s attention output to layer ``i``'s inputs, the
last to the final norm. Replayed, the pieces alternate with each layer's attention, run eagerly on
the step's own metadata (its grid follows the sequences' lengths, which only the host knows): for
SmolLM2, 31 replays and 30 attention calls instead of ~300 launches: a 128-token prefill step 29 ms
→ 5.4 ms on an H100 (benchmarks/results/step_phases_prefill_graphs_h100.jsonl), most of what is
left being those attention calls' host work. ``--cuda-graph-prefill-tokens`` (default 2048).

Static buffers, sized for the largest bucket and shared by every bucket and layer: input ids,
positions and each layer group's slots (rows past the step's tokens get slot -1: nothing stored),
the attention's inputs (q and the chunk's keys and values, copied there at the end of each piece)
and its output (read by the next piece). Rows past the step's tokens compute values that stay in
their rows (every op but attention is row by row) and are dropped. Each bucket's pieces are
captured in order, largest bucket first, into one memory pool, and replayed in that order. Without
``capture`` the same buffers run the model eagerly, attention between them as in a replay (how the
padding is tested on the CPU).
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts the graphs are captured at: every 16 up to 256, then eight an octave (a step of
    more than 128 tokens pads at most 1/8 of them), then ``max_tokens``."""
    buckets, size, step = [], 16, 16
    while size < max_tokens:
        buckets.append(size)
        if size >= 16 * step:
            step *= 2
        size += step
    return buckets + [max_tokens]


class _Attention(NamedTuple):
    """One layer's attention call, as the model made it, but for the step's metadata."""

    group: int  # whose block tables, lengths and starts it reads
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class _PieceOps:
    """The model's op set with ``paged_attention`` handed to the graphs; every other op is the base's."""

    def __init__(self, base, graphs: PrefillGraphs):
        self.base = base
        self._graphs = graphs

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def paged_attention(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        seq_lens_cpu=None, query_start_loc_cpu=None, key=None, value=None, sliding_window=None,
                        k_scale=None, v_scale=None) -> torch.Tensor:
        call = _Attention(self._graphs.group_of(block_tables), k_cache, v_cache, scale, sliding_window,
                          k_scale, v_scale)
        return self._graphs.attention_break(q, key, value, call)


class PrefillGraphs:
    """Static buffers, and with ``capture`` every bucket's pieces. Not thread-safe; call ``run`` and
    ``capture`` inside ``torch.inference_mode``."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, buckets: list[int], num_groups: int, capture: bool):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.buckets = buckets
        self.max_tokens = buckets[-1]
        self.num_groups = num_groups
        self.capture_graphs = capture
        c, n = model.config, buckets[-1]
        dtype = model.factory["dtype"]  # the activations' (an fp8 model's weights are not)
        self._ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._slots = torch.full((num_groups, n), -1, dtype=torch.int64, device=device)
        self._q = torch.zeros(n, c.num_heads, c.head_dim, dtype=dtype, device=device)
        self._k = torch.zeros(n, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
        self._v = torch.zeros_like(self._k)
        self._out = torch.zeros(n, c.num_heads * c.head_dim, dtype=dtype, device=device)
        # What the model's metadata holds besides the slots: read by no op of a piece, one block
        # table tensor per group, by which the attention calls name their group.
        self._tables = [torch.zeros((1, 1), dtype=torch.int32, device=device) for _ in range(num_groups)]
        self._groups = {id(tables): group for group, tables in enumerate(self._tables)}
        self._lens = torch.zeros(2, dtype=torch.int32, device=device)
        self._base_ops = model.ops
        self._piece_ops = _PieceOps(model.ops, self)
        self._step: tuple[AttentionMetadata, int] | None = None  # the step's metadata and token count
        # With capture: the pieces and attention calls of each bucket, and its output hidden states
        self._pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._calls: dict[int, list[_Attention]] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._capturing: tuple[list[torch.cuda.CUDAGraph], list[_Attention], object] | None = None

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def group_of(self, block_tables: torch.Tensor) -> int:
        return self._groups[id(block_tables)]

    # --- a step --------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a step's ``input_ids`` (at most ``max_tokens``) at ``positions``, with
        ``attn`` its metadata (each group's slots); writes their K/V. A view of a static buffer: valid
        until the next ``run``."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        self._ids[:n].copy_(input_ids)
        self._positions[:n].copy_(positions)
        for group in range(self.num_groups):
            self._slots[group, :n].copy_(attn.group(group).slot_mapping)
            self._slots[group, n:size].fill_(-1)
        self._step = (attn, n)
        try:
            if not self.capture_graphs:
                return self._forward(size)[:n]
            for piece, call in zip(self._pieces[size], self._calls[size]):
                piece.replay()
                self._attend(call)
            self._pieces[size][-1].replay()
            return self._hidden[size][:n]
        finally:
            self._step = None

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers' first ``size`` rows, the attention calls handed to
        :meth:`attention_break`."""
        attn = self._metadata(size, self._tables, self._lens[:1], self._lens)
        self.model.use_ops(self._piece_ops)
        try:
            return self.model(self._ids[:size], self._positions[:size], attn, self.kv_caches)
        finally:
            self.model.use_ops(self._base_ops)

    def _metadata(self, size: int, tables: list[torch.Tensor], seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor) -> AttentionMetadata:
        """One sequence of ``size`` new tokens at the static slots, each group with its ``tables``."""
        groups = tuple(AttentionMetadata(
            block_tables=tables[group], seq_lens=seq_lens, query_start_loc=query_start_loc,
            slot_mapping=self._slots[group, :size], seq_lens_cpu=[size], query_start_loc_cpu=[0, size],
            max_query_len=size, max_seq_len=size,
        ) for group in range(self.num_groups))
        if self.num_groups > 1:
            groups[0].groups = groups
        return groups[0]

    def attention_break(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        call: _Attention) -> torch.Tensor:
        """A layer's attention inside :meth:`_forward`: its inputs go to the static buffers, then (a
        capture) the piece ends and the next one begins, or (no capture) the attention runs; returns
        the static output, which the rest of the layer reads."""
        size = q.shape[0]
        self._q[:size].copy_(q)
        self._k[:size].copy_(key)
        self._v[:size].copy_(value)
        if self._capturing is not None:
            pieces, calls, pool = self._capturing
            pieces[-1].capture_end()
            calls.append(call)
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)
        else:
            self._attend(call)
        return self._out[:size].view(size, *q.shape[1:])

    def _attend(self, call: _Attention) -> None:
        """One layer's attention over the step's tokens, from the static inputs to the static output."""
        attn, n = self._step
        meta = attn.group(call.group)
        q = self._q[:n]
        self._base_ops.paged_attention(
            q, call.k_cache, call.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            call.scale, meta.seq_lens_cpu, meta.query_start_loc_cpu, key=self._k[:n], value=self._v[:n],
            sliding_window=call.sliding_window, k_scale=call.k_scale, v_scale=call.v_scale,
            out=self._out[:n].view(q.shape),
        )

    # --- capture -------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket's pieces, largest first, into one pool (each bucket first run once
        eagerly: compiles and autotunes outside the capture)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):
                self._step = (self._warmup_metadata(size), size)
                self._forward(size)
                pieces, calls = [torch.cuda.CUDAGraph()], []
                self._capturing = (pieces, calls, pool)
                pieces[0].capture_begin(pool=pool)
                try:
                    hidden = self._forward(size)
                finally:
                    self._capturing = None
                    pieces[-1].capture_end()
                    self._step = None
                self._pieces[size], self._calls[size], self._hidden[size] = pieces, calls, hidden
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _warmup_metadata(self, size: int) -> AttentionMetadata:
        """One sequence of ``size`` new tokens that stores nothing (every slot -1), for the eager run
        before a capture."""
        self._slots[:, :size].fill_(-1)
        width = -(-size // self.kv_caches[0][0].shape[1])
        tables = [torch.zeros((1, width), dtype=torch.int32, device=self.device)] * self.num_groups
        seq_lens = torch.tensor([size], dtype=torch.int32, device=self.device)
        return self._metadata(size, tables, seq_lens, torch.tensor([0, size], dtype=torch.int32, device=self.device))
