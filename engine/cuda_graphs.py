"""CUDA graphs of decode-only steps, per batch bucket and context bound, replayed with padded inputs.

A step of ``n`` single-token sequences replays the graph of the smallest bucket ``b >= n``; rows
``n … b-1`` are padding (slot -1: nothing stored; context length 0: zero attention output) and
their outputs are dropped. Each bucket has a graph for contexts up to FUSED_DECODE_MAX_CONTEXT
(the fused decode attention) and one for any context (the split-K ops): a step replays the first
that fits its longest context. Every graph reads the same static input buffers, sized for the
largest bucket, with block tables at the full ``max_model_len`` width (the decode kernels' split
counts depend on that width, never on the lengths, so one capture serves every length it bounds).
The graphs share one memory pool, captured largest first, and one logits buffer, so their memory
is about the largest bucket's activations and logits, which stay in the head's dtype. The LM head
and ``sample_argmax`` run inside the graph, the rows' inverse temperatures (0: the argmax) and the
noise's seed among the static inputs: a step whose rows are all greedy or at a temperature alone
(``Sampler.direct_draw``) launches nothing more; any other step samples from the graph's logits
outside it (per-request generators, filters, penalties, logprobs).

With ``query_len`` q > 1 the same machinery captures speculative verification steps: every row is
q query tokens (a decoding sequence's last token and its draft, padded to q: padding tokens store
nothing), the attention is the varlen paged kernel, and the logits of all q rows come back.
Padding rows are q tokens at positions 0 … q-1 that store nothing; their outputs are dropped.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.attention import FUSED_DECODE_MAX_CONTEXT, AttentionMetadata
from engine.kv_groups import group_tables
from engine.request import Sequence

if TYPE_CHECKING:
    from engine.sampler import DirectDraw


class CarriedTokens(NamedTuple):
    """Input tokens still on the device: the previous step's sampled ``tokens`` ([rows] int64) and
    ``rows``, (input row, row of ``tokens``) pairs in input-row order."""

    tokens: torch.Tensor
    rows: list[tuple[int, int]]

    def scatter(self, input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write the carried tokens into ``input_ids``; ``dst``/``src``: ``rows`` on the device."""
        k = len(self.rows)
        if self.rows[-1][0] == k - 1 and all(d == s for d, s in self.rows):  # 0..k-1 from 0..k-1: a plain decode step
            input_ids[:k].copy_(self.tokens[:k])
        else:
            input_ids.index_copy_(0, dst, self.tokens.index_select(0, src))


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # [num_seqs, vocab] in the model's logits_dtype, a view of the graph's static output
    tokens: torch.Tensor  # [num_seqs] int64, each row's argmax, or its draw where ``run`` was given a DirectDraw

# Static int64 rows (input ids, positions, slots) are padded to this many entries so that each
# row starts 128-byte aligned, as the eager path's fresh tensors do (Triton specializes on it).
_ROW_ALIGN = 16
# Each static input starts this many bytes into their common buffer (Triton specializes on alignment).
_REGION_ALIGN = 128


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``: a step pads
    at most 15 rows past 8 sequences."""
    return [b for b in (1, 2, 4, 8, *range(16, max_num_seqs, 16)) if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Static buffers, and with ``capture`` one CUDA graph per bucket. Without ``capture`` the
    same padded buffers run the model eagerly (how the padding logic is tested on the CPU).
    Not thread-safe; call ``run`` and ``capture`` inside ``torch.inference_mode``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        block_size: int,
        max_blocks_per_seq: int,
        buckets: list[int],
        capture: bool,
        num_groups: int = 1,
        query_len: int = 1,
    ):
        """``num_groups``: the KV layer groups (engine.kv_groups), each with its own block tables
        and slots."""
        self.model = model
        self.num_groups = num_groups
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.buckets = buckets
        self.max_batch_size = buckets[-1]
        self.capture_graphs = capture
        self.capacity = max_blocks_per_seq * block_size
        self.query_len = q = query_len
        # Each bucket is captured per context bound: steps whose contexts all fit the short one
        # take the fused decode attention, the others the split-K ops (see AttentionMetadata).
        self.context_bounds = sorted({min(FUSED_DECODE_MAX_CONTEXT, self.capacity) if q == 1 else self.capacity,
                                      self.capacity})
        width = -(-self.max_batch_size * q // _ROW_ALIGN) * _ROW_ALIGN
        pin = device.type == "cuda"
        # The static inputs are views of one byte buffer, filled on the host (pinned staging, written
        # with numpy) and copied to the device in one transfer per step, as far as the step's block
        # table rows reach: the id rows (input ids, positions, each group's slots, then the rows whose
        # input id is a token of the previous step still on the device, and where that step's tokens
        # hold it: overlapped steps), each row's inverse temperature and the seed of the graph's
        # sample_argmax, the context lengths, then each group's block tables. Each stream op costs
        # the device microseconds between two replays, whatever its size.
        self._slot_rows = slice(2, 2 + num_groups)
        self._dst_row, self._src_row = 2 + num_groups, 3 + num_groups
        shapes = ((torch.int64, (4 + num_groups, width)), (torch.float32, (width,)), (torch.int64, (1,)),
                  (torch.int32, (self.max_batch_size,)),
                  (torch.int32, (num_groups, self.max_batch_size, max_blocks_per_seq)))
        offsets, size = [], 0
        for dtype, shape in shapes:
            offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // _REGION_ALIGN) * _REGION_ALIGN
        self._table_offset, self._table_row_bytes = offsets[-1], max_blocks_per_seq * 4
        host_inputs = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self._inputs = torch.zeros(size, dtype=torch.uint8, device=device)

        def views(buffer: torch.Tensor) -> list[torch.Tensor]:
            return [buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                    for offset, (dtype, shape) in zip(offsets, shapes)]

        self._host_inputs = host_inputs
        self._np_ids, self._np_inv_temperature, self._np_seed, self._np_seq_lens, self._np_tables = (
            view.numpy() for view in views(host_inputs))
        self._ids, self._inv_temperature, self._seed, self._seq_lens, self._tables = views(self._inputs)
        # Per group and staging row: the block list it was filled from and how many of its ids it
        # holds. A sequence's list only grows while the sequence holds its blocks (freeing them
        # replaces the list; a window group's entries before the window, which attention never
        # reads, may go stale), so a row is rewritten only from where it changed.
        self._table_rows: list[list[tuple[list[int] | None, int]]] = [
            [(None, 0)] * self.max_batch_size for _ in range(num_groups)
        ]
        self._ids[self._slot_rows].fill_(-1)
        self._np_ids[self._slot_rows] = -1
        self._query_start_loc = torch.arange(0, (self.max_batch_size + 1) * q, q, dtype=torch.int32, device=device)
        # Every graph writes its logits here: one [max batch * q, vocab] buffer, not one per graph, in the
        # head's own dtype (widening 256 rows of a 152K vocabulary to fp32 costs ~0.1 ms a step).
        self._logits = torch.empty((self.max_batch_size * q, model.config.vocab_size), dtype=model.logits_dtype,
                                   device=device)
        # The staging buffers are rewritten only once the previous step's copies are done.
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], DecodeOutput] = {}

    def bucket(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def graph_key(self, num_seqs: int, longest_context: int) -> tuple[int, int]:
        """(bucket, context bound) of the graph that runs such a step."""
        return self.bucket(num_seqs), next(b for b in self.context_bounds if longest_context <= b)

    def graph(self, num_seqs: int, longest_context: int) -> torch.cuda.CUDAGraph:
        """The captured graph that runs such a step, for benchmarks that replay it alone."""
        return self._graphs[self.graph_key(num_seqs, longest_context)]

    def skip_kv_stores(self) -> None:
        """Until the next ``run``, replays store no K/V (every slot -1), so replaying the last
        step's inputs again leaves the cache as it was."""
        self._ids[self._slot_rows].fill_(-1)

    def _forward(self, batch_size: int, context_bound: int, seq_lens_cpu: list[int]) -> DecodeOutput:
        q = self.query_len
        num_tokens = batch_size * q
        groups = tuple(
            AttentionMetadata(
                block_tables=self._tables[group, :batch_size],
                seq_lens=self._seq_lens[:batch_size],
                query_start_loc=self._query_start_loc[: batch_size + 1],
                slot_mapping=self._ids[2 + group, :num_tokens],
                seq_lens_cpu=seq_lens_cpu,
                query_start_loc_cpu=list(range(0, num_tokens + 1, q)),
                max_query_len=q,
                max_seq_len=context_bound,
            )
            for group in range(self.num_groups)
        )
        attn = groups[0]
        if self.num_groups > 1:
            attn.groups = groups
        hidden = self.model(self._ids[0, :num_tokens], self._ids[1, :num_tokens], attn, self.kv_caches)
        logits = self.model.compute_logits(hidden, out=self._logits[:num_tokens])
        ops = self.model.ops
        if q > 1:  # verification: its logits are what the step reads
            return DecodeOutput(logits, ops.argmax(logits))
        return DecodeOutput(logits, ops.sample_argmax(logits, self._inv_temperature[:num_tokens], self._seed))

    def capture(self) -> int:
        """Capture every bucket at every context bound, largest first, into one pool; returns
        the device bytes taken."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.buckets):
            padding = [0 if self.query_len == 1 else self.query_len] * batch_size
            for bound in self.context_bounds:
                self._forward(batch_size, bound, padding)  # compiles and autotunes outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[batch_size, bound] = self._forward(batch_size, bound, padding)
                self._graphs[batch_size, bound] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return free_before - torch.cuda.mem_get_info(self.device)[0]

    def fits(self, seqs: Seq[Sequence]) -> bool:
        """Whether ``run`` takes these decoding sequences: few enough, each draft short enough,
        and (q > 1) the padded queries inside the block table's capacity."""
        q = self.query_len
        return len(seqs) <= self.max_batch_size and all(
            len(s.draft_ids) < q and (q == 1 or s.num_computed_tokens + q <= self.capacity) for s in seqs
        )

    def run(self, seqs: Seq[Sequence], carried: CarriedTokens | None = None,
            draw: DirectDraw | None = None) -> DecodeOutput:
        """Logits and token of the next position of each sequence (each has exactly one token to
        compute, its draft if q > 1, and its blocks allocated); row ``i * q + j`` is sequence ``i``'s
        ``j``-th query token. Writes their K/V into the cache. The outputs are views of static
        buffers: valid until the next ``run``. ``carried`` (q == 1): the sequences whose token is
        still pending, read from the previous step's tokens on the device. ``draw`` (q == 1, one
        entry a sequence): the tokens are sample_argmax's with these temperatures and seed."""
        n = len(seqs)
        q = self.query_len
        if self._copied is not None:
            self._copied.synchronize()
        ids, seq_lens, tables = self._np_ids, self._np_seq_lens, self._np_tables
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            seq_lens[i] = pos + q
            if q == 1:
                ids[0, i] = seq.all_token_ids[pos] if pos < len(seq.all_token_ids) else 0  # else carried
                ids[1, i] = pos
            else:
                tokens = [seq.all_token_ids[pos], *seq.draft_ids]
                row = slice(i * q, (i + 1) * q)
                ids[0, row] = tokens + [0] * (q - len(tokens))
                ids[1, row] = range(pos, pos + q)
            for group, blocks in enumerate(group_tables(seq)):
                if q == 1:
                    ids[2 + group, i] = blocks[pos // bs] * bs + pos % bs
                else:
                    ids[2 + group, row] = [blocks[p // bs] * bs + p % bs for p in range(pos, pos + len(tokens))] + \
                        [-1] * (q - len(tokens))
                held, written = self._table_rows[group][i]
                if held is not blocks:
                    written = 0
                if written < len(blocks):
                    tables[group, i, written : len(blocks)] = blocks[written:]
                    self._table_rows[group][i] = (blocks, len(blocks))
        key = self.graph_key(n, int(seq_lens[:n].max()))
        batch_size = key[0]
        ids[0, n * q : batch_size * q] = 0
        ids[1, n * q : batch_size * q] = list(range(q)) * (batch_size - n)
        ids[self._slot_rows, n * q : batch_size * q] = -1
        seq_lens[n:batch_size] = 0 if q == 1 else q
        inv_temperature = self._np_inv_temperature
        if draw is None:
            inv_temperature[:batch_size] = 0.0
        else:
            inv_temperature[:n], inv_temperature[n:batch_size] = draw.inv_temperature, 0.0
            self._np_seed[0] = draw.seed
        num_carried = 0 if carried is None else len(carried.rows)
        if num_carried:
            ids[self._dst_row, :num_carried], ids[self._src_row, :num_carried] = zip(*carried.rows)
        # the last group's first n table rows end the copy (earlier groups' go whole)
        end = self._table_offset + ((self.num_groups - 1) * self.max_batch_size + n) * self._table_row_bytes
        self._inputs[:end].copy_(self._host_inputs[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if num_carried:
            ids_dev = self._ids
            carried.scatter(ids_dev[0], ids_dev[self._dst_row, :num_carried], ids_dev[self._src_row, :num_carried])
        if self.capture_graphs:
            self._graphs[key].replay()
            out = self._outputs[key]
        else:
            out = self._forward(*key, seq_lens[:batch_size].tolist())
        return DecodeOutput(out.logits[: n * q], out.tokens[: n * q])
