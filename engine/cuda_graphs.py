"""CUDA graphs of decode-only steps, one per batch bucket, replayed with padded inputs.

A step of ``n`` single-token sequences replays the graph of the smallest bucket ``b >= n``; rows
``n … b-1`` are padding (slot -1: nothing stored; context length 0: zero attention output) and
their hidden states are dropped. Every graph reads the same static input buffers, sized for the
largest bucket, with block tables at the full ``max_model_len`` width (the decode kernel's split
count depends on that width, never on the lengths, so one capture serves every context length).
The graphs share one memory pool, captured largest first, so their memory is about the largest
bucket's activations. Sampling stays outside the graph (per-request generators and penalties).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq

import torch

from engine.attention import AttentionMetadata
from engine.request import Sequence

# Static int64 rows (input ids, positions, slots) are padded to this many entries so that each
# row starts 128-byte aligned, as the eager path's fresh tensors do (Triton specializes on it).
_ROW_ALIGN = 16


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
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.buckets = buckets
        self.max_batch_size = buckets[-1]
        self.capture_graphs = capture
        self.capacity = max_blocks_per_seq * block_size
        width = -(-self.max_batch_size // _ROW_ALIGN) * _ROW_ALIGN
        pin = device.type == "cuda"
        # Host staging: filled with numpy, copied to the device in three transfers per step.
        self._host_ids = torch.zeros((3, width), dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(self.max_batch_size, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((self.max_batch_size, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self._np_ids, self._np_seq_lens, self._np_tables = (
            self._host_ids.numpy(), self._host_seq_lens.numpy(), self._host_tables.numpy()
        )
        self._ids = torch.zeros((3, width), dtype=torch.int64, device=device)
        self._ids[2].fill_(-1)
        self._seq_lens = torch.zeros(self.max_batch_size, dtype=torch.int32, device=device)
        self._tables = torch.zeros((self.max_batch_size, max_blocks_per_seq), dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(self.max_batch_size + 1, dtype=torch.int32, device=device)
        # The staging buffers are rewritten only once the previous step's copies are done.
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def bucket(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def _forward(self, batch_size: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        attn = AttentionMetadata(
            block_tables=self._tables[:batch_size],
            seq_lens=self._seq_lens[:batch_size],
            query_start_loc=self._query_start_loc[: batch_size + 1],
            slot_mapping=self._ids[2, :batch_size],
            seq_lens_cpu=seq_lens_cpu,
            query_start_loc_cpu=list(range(batch_size + 1)),
            max_query_len=1,
            max_seq_len=self.capacity,
        )
        return self.model(self._ids[0, :batch_size], self._ids[1, :batch_size], attn, self.kv_caches)

    def capture(self) -> int:
        """Capture every bucket, largest first, into one pool; returns the device bytes taken."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.buckets):
            padding = [0] * batch_size
            self._forward(batch_size, padding)  # compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[batch_size] = self._forward(batch_size, padding)
            self._graphs[batch_size] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return free_before - torch.cuda.mem_get_info(self.device)[0]

    def run(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Hidden states ``[len(seqs), hidden]`` of the next token of each sequence (each has
        exactly one token to compute, and its blocks allocated). Writes its K/V into the cache."""
        n = len(seqs)
        batch_size = self.bucket(n)
        if self._copied is not None:
            self._copied.synchronize()
        ids, seq_lens, tables = self._np_ids, self._np_seq_lens, self._np_tables
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            blocks = seq.block_ids
            ids[0, i] = seq.all_token_ids[pos]
            ids[1, i] = pos
            ids[2, i] = blocks[pos // bs] * bs + pos % bs
            seq_lens[i] = pos + 1
            tables[i, : len(blocks)] = blocks
        ids[:2, n:batch_size] = 0
        ids[2, n:batch_size] = -1
        seq_lens[n:batch_size] = 0
        self._ids.copy_(self._host_ids, non_blocking=True)
        self._seq_lens[:batch_size].copy_(self._host_seq_lens[:batch_size], non_blocking=True)
        self._tables[:n].copy_(self._host_tables[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.capture_graphs:
            self._graphs[batch_size].replay()
            hidden = self._outputs[batch_size]
        else:
            hidden = self._forward(batch_size, seq_lens[:batch_size].tolist())
        return hidden[:n]
