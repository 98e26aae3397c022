"""Host memory of a CPU engine: KV pages committed as they are written, and the process's RSS."""

from __future__ import annotations

import mmap
import os

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor over an anonymous mapping: the OS hands out zero pages as they are first
    touched, so a KV pool costs resident memory only for the pages sequences have written."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    # the tensor keeps the mapping alive (frombuffer holds a reference to it)
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
