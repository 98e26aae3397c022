"""Kernels: the op contract (``KernelOps``), met by the Triton kernels (``kernels.triton_ops``)
and by their torch reference twins (``kernels.reference``), and ``load_ops`` to pick one.

Layouts (shared by every implementation):
- a flattened varlen batch: ``num_tokens`` rows; sequence ``i`` owns rows
  ``query_start_loc[i]:query_start_loc[i+1]`` (its new tokens this step);
- ``seq_lens[i]``: the sequence's context length *after* this step (cached + new tokens), so its
  new tokens sit at positions ``seq_lens[i] - q_len_i … seq_lens[i] - 1``;
- KV cache per layer: ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
  head_dim]``; ``block_tables[i, j]`` is the physical block of the sequence's ``j``-th logical
  block; ``slot_mapping[t] = block * block_size + offset`` is where token row ``t`` is stored.
- an fp8 (``float8_e4m3fn``) KV cache holds ``x / scale`` per kv head, rounded to nearest and
  saturated at ±448: ``k_scale``/``v_scale`` ``[num_kv_heads]`` fp32 (required by an fp8 cache,
  ignored by any other) are passed to every op that reads or writes the cache, which reads
  ``stored * scale``. Attention over an fp8 cache reads every key, the new ones included, as stored.

The Triton ops raise ``ValueError`` naming the argument on a shape, dtype, stride or device they
cannot take; the reference ops assume valid inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

BACKENDS = ("torch", "triton")


class QKNorm(NamedTuple):
    """Per-head RMSNorms of q and k before RoPE (Qwen3, Gemma 3): each head's ``head_dim`` values
    normed in fp32 with ``eps``, times the weight, rounded to q's dtype (as ``rms_norm`` returns
    them); RoPE then rotates the rounded values."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor  # [head_dim]
    eps: float


class KernelOps(Protocol):
    """The op set a model runs on: a module with these functions (``self`` aside)."""

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: padding, not stored
        k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: an fp8 cache's scales
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write each token's K/V into its paged slot (in place), in the cache's dtype. Slots
        must lie inside the cache."""

    def paged_attention(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
        scale: float,
        seq_lens_cpu: list[int] | None = None,
        query_start_loc_cpu: list[int] | None = None,
        key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], as stored by store_kv
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,  # like q: where the output goes, instead of a new tensor
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole paged context, or with
        ``sliding_window`` W over its last W positions only: a query at position p sees keys
        ``p - W + 1 … p``, and no page that holds none of them is read (its block table entry
        may be anything a valid block id; a window layer's pages before it may be freed).

        Covers decode (one new token), chunked prefill (many new tokens after a cached prefix) and
        mixed batches of both. Returns ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype (``out``
        when given); only rows that belong to a sequence are defined. A sequence with ``seq_lens[i] == 0`` and
        one query token (a padding row) gets zeros. The ``*_cpu`` lists are optional host copies
        that spare a device sync (pass ``query_start_loc_cpu`` under CUDA graph capture).
        ``key``/``value``, optional, are this step's new K/V rows, already written to the cache:
        an implementation may read the new chunks from them instead of the cache.
        """

    def decode_attention(
        self,
        positions: torch.Tensor,  # [num_seqs] int64, each new token's RoPE position
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], before RoPE
        k: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim], before RoPE
        v: torch.Tensor,  # [num_seqs, num_kv_heads, head_dim]
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_seqs] int64; negative: a padding row, not stored
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
        scale: float,
        seq_lens_cpu: list[int] | None = None,
        sliding_window: int | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """A decode-only step's attention, from the new tokens' projections to the output
        ``[num_seqs, num_heads, head_dim]`` in ``q``'s dtype: row ``i`` is sequence ``i``'s one new
        token, at context position ``seq_lens[i] - 1``. RoPE on q and k (after ``qk_norm``), the new
        k/v written to the cache at ``slot_mapping`` (in place), then attention over the whole
        context: exactly ``rotary_embedding``, ``store_kv`` and ``paged_attention`` with one query
        per sequence.
        ``q``/``k``/``v`` may be strided views of a fused qkv projection. A padding row
        (``slot_mapping[i] < 0``) must have ``seq_lens[i] == 0``; its output is zeros.
        ``seq_lens_cpu``, optional, only lets the lengths be checked against the table's capacity.
        ``sliding_window`` as for ``paged_attention``."""

    def rms_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] (any leading dims; last dim contiguous)
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual`` (or ``x``), then RMSNorm of it in fp32.

        Returns ``(normed, residual)``, new tensors (``residual`` is ``x`` itself when none is
        given); the fused form saves one read and write of the hidden state.
        """

    def rope_cos_sin_cache(
        self, head_dim: int, max_position: int, theta: float, device=None, dtype=torch.float32
    ) -> torch.Tensor:
        """``[max_position, head_dim]``: cos in the first half, sin in the second (NeoX / HF layout)."""

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
        qk_norm: QKNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE (HF Llama convention), computed in fp32, of q and k (normed first by
        ``qk_norm``, when given); returns new contiguous q, k. ``q``/``k`` may be strided views (of
        a fused qkv). Positions must lie inside the cache."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d`` (gate then up)."""

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T`` (bias-free) for ``x [num_tokens, in_features]``, ``weight [out_features, in_features]``.

        With ``weight_scale [out_features]`` fp32, ``weight`` is fp8 (E4M3) holding ``w / scale`` per
        output channel. Each row of ``x`` is quantized to fp8 over its own scale (absolute maximum
        / 448), and the product of the fp8 values, accumulated in fp32, is multiplied by both
        scales. Returned in ``x``'s dtype."""

    def norm_linear(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        norm_weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None,
        weight: torch.Tensor,  # [out_features, hidden]; gated: [2 * out_features, hidden] (gate, then up)
        gated: bool = False,
        weight_scale: torch.Tensor | None = None,  # [out_features] (gated: [2 * out_features]), fp8 weight
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm (with the residual add), ``linear`` of the normed rows and, when ``gated``,
        silu_and_mul of the product. Returns ``(out, residual)``, the residual as rms_norm's."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value (the first, on ties), as ``torch.argmax(-1)``:
        ``[rows, vocab] -> [rows]`` int64."""

    def sample_argmax(
        self,
        logits: torch.Tensor,
        inv_temperature: torch.Tensor,  # [rows] fp32
        seed: int | torch.Tensor,  # in [0, 2**63), or a one-element int64 tensor on the logits' device holding it
    ) -> torch.Tensor:
        """Each row's token, ``[rows]`` int64: where ``inv_temperature`` is positive, a draw from
        ``softmax(logits * inv_temperature)`` (Gumbel-max: the argmax of ``logits * inv_temperature``
        plus Gumbel noise, a function of ``seed``, the row and the column); where it is 0, ``argmax``'s.
        Each implementation has its own noise stream: the same seed gives the same tokens on one. A
        seed tensor is read when the op runs (a CUDA graph replays it with the seed it then holds)."""


def load_ops(backend: str) -> KernelOps:
    """The op set of ``backend`` (one of ``BACKENDS``)."""
    if backend == "torch":
        from kernels import reference

        return reference
    if backend == "triton":
        from kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
