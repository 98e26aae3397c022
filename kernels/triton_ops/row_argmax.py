"""argmax and sample_argmax: each row's first largest value (with Gumbel noise, a draw) in one
launch, its chunks merged by the last to finish."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops._checks import _FLOAT_DTYPES, _check, _check_devices, _check_last_dim_contiguous, _check_tensor
from kernels.triton_ops._launch import _arrival_counters

_ARGMAX_BLOCK = 4096  # values per program (at most)
_ARGMAX_MAX_CHUNKS = 64  # programs per row, merged by the last to finish (vocabularies up to 256K)


@triton.jit
def _gumbel(x, inv_temp, u):
    """``x * inv_temp`` plus Gumbel noise from the uniform ``u`` (u = 0: -inf, never drawn)."""
    return x * inv_temp - tl.log(-tl.log(u))


@triton.jit
def _first(x, best, cols, width):
    """The smallest of ``cols`` where ``x`` is ``best`` (``width`` where none is)."""
    return tl.min(tl.where(x == best, cols, width), 0)


@triton.jit(do_not_specialize=["width", "seed"])
def _argmax_kernel(
    x_ptr, out_ptr, partial_val_ptr, partial_idx_ptr, counters_ptr, width, x_stride, inv_temp_ptr, seed,
    BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, SEED_IN_MEMORY: tl.constexpr,
):
    """Program (row, chunk): the chunk's largest value and its first index, written as a
    partial; the row's last program to arrive merges the partials (the largest value, then the
    smallest index) and resets the row's counter to 0 for the next launch. With ``inv_temp_ptr``,
    a row whose inverse temperature is positive compares ``x * inv_temp + gumbel`` instead, the
    noise of the chunk's four quarters from one Philox call at (``seed``, row * width + the first
    quarter's column; SEED_IN_MEMORY: ``seed`` points at it, so a CUDA graph replays with fresh
    seeds); without, the chunk is one block, as the plain argmax always was."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row_ptr = x_ptr + row.to(tl.int64) * x_stride
    if inv_temp_ptr is None:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        best = tl.max(x, 0)
        best_idx = _first(x, best, cols, width)
    else:
        # The chunk as four quarters: one Philox call draws the noise of a column in each.
        QUARTER: tl.constexpr = BLOCK // 4
        cols = chunk * BLOCK + tl.arange(0, QUARTER)
        x0 = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        x1 = tl.load(row_ptr + cols + QUARTER, mask=cols + QUARTER < width, other=float("-inf")).to(tl.float32)
        x2 = tl.load(row_ptr + cols + 2 * QUARTER, mask=cols + 2 * QUARTER < width, other=float("-inf")).to(tl.float32)
        x3 = tl.load(row_ptr + cols + 3 * QUARTER, mask=cols + 3 * QUARTER < width, other=float("-inf")).to(tl.float32)
        inv_temp = tl.load(inv_temp_ptr + row)
        if inv_temp > 0:
            # New names: a runtime branch may not give ``seed`` (a pointer, with SEED_IN_MEMORY) another type.
            offsets = row.to(tl.int64) * width + cols
            if SEED_IN_MEMORY:
                u0, u1, u2, u3 = tl.rand4x(tl.load(seed), offsets)
            else:
                u0, u1, u2, u3 = tl.rand4x(seed, offsets)
            x0 = _gumbel(x0, inv_temp, u0)
            x1 = _gumbel(x1, inv_temp, u1)
            x2 = _gumbel(x2, inv_temp, u2)
            x3 = _gumbel(x3, inv_temp, u3)
        best = tl.maximum(tl.maximum(tl.max(x0, 0), tl.max(x1, 0)), tl.maximum(tl.max(x2, 0), tl.max(x3, 0)))
        best_idx = tl.minimum(tl.minimum(_first(x0, best, cols, width), _first(x1, best, cols + QUARTER, width)),
                              tl.minimum(_first(x2, best, cols + 2 * QUARTER, width),
                                         _first(x3, best, cols + 3 * QUARTER, width)))
    if num_chunks == 1:
        tl.store(out_ptr + row, best_idx.to(tl.int64))
        return
    partial = row * num_chunks + chunk
    tl.store(partial_val_ptr + partial, best)
    tl.store(partial_idx_ptr + partial, best_idx)
    counter = counters_ptr + row
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_chunks - 1:
        c = tl.arange(0, CHUNKS_PAD)
        c_ok = c < num_chunks
        vals = tl.load(partial_val_ptr + row * num_chunks + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(partial_idx_ptr + row * num_chunks + c, mask=c_ok, other=0, cache_modifier=".cg")
        top = tl.max(vals, 0)
        tl.store(out_ptr + row, tl.min(tl.where(c_ok & (vals == top), idxs, width), 0).to(tl.int64))
        tl.store(counter, 0)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """One launch: chunks of a row reduce in parallel and the last to finish merges them. No host
    sync: it may be captured in a CUDA graph once it has run eagerly on the device."""
    _check_logits(logits)
    return _launch(logits, None, 0)


def sample_argmax(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """As ``argmax``, each row's noise drawn in the kernel (Philox, keyed by ``seed``, or by the value
    a one-element int64 tensor holds when the kernel runs): one read of the logits, nothing written
    but the tokens."""
    _check_logits(logits)
    _check_tensor("inv_temperature", inv_temperature, 1, (torch.float32,))
    _check(inv_temperature.shape[0] == logits.shape[0],
           lambda: f"inv_temperature has {inv_temperature.shape[0]} rows, logits {logits.shape[0]}")
    _check_devices(logits=logits, inv_temperature=inv_temperature)
    if isinstance(seed, torch.Tensor):
        _check(seed.dtype == torch.int64 and seed.numel() == 1,
               lambda: f"a seed tensor must hold one int64, got {seed.dtype} of shape {tuple(seed.shape)}")
        _check_devices(logits=logits, seed=seed)
    else:
        _check(0 <= seed < 2**63, lambda: f"seed must be in [0, 2**63), got {seed}")
    return _launch(logits, inv_temperature.contiguous(), seed)


def _check_logits(logits: torch.Tensor) -> None:
    _check_tensor("logits", logits, 2, _FLOAT_DTYPES)
    _check_last_dim_contiguous("logits", logits)
    _check_devices(logits=logits)
    _check(logits.shape[1] > 0, "logits must have at least one column")
    _check(triton.cdiv(logits.shape[1], _ARGMAX_BLOCK) <= _ARGMAX_MAX_CHUNKS,
           lambda: f"rows wider than {_ARGMAX_MAX_CHUNKS * _ARGMAX_BLOCK} are not supported")


def _launch(logits: torch.Tensor, inv_temperature: torch.Tensor | None, seed: int | torch.Tensor) -> torch.Tensor:
    rows, width = logits.shape
    block = min(_ARGMAX_BLOCK, max(4, triton.next_power_of_2(width)))
    num_chunks = triton.cdiv(width, block)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    # One chunk a row merges nothing: any rows, no counters (the kernel returns before it reads them).
    counters = _arrival_counters(logits.device, rows, "argmax") if num_chunks > 1 else out
    partial_val = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    partial_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, num_chunks)](
        logits, out, partial_val, partial_idx, counters, width, logits.stride(0), inv_temperature, seed,
        BLOCK=block, CHUNKS_PAD=triton.next_power_of_2(num_chunks), SEED_IN_MEMORY=isinstance(seed, torch.Tensor),
        num_warps=4,
    )
    return out
