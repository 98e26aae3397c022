"""A faster ``gguf.GGUFReader`` (torch-free: the gateway uses it too).

The reader parses every metadata array element by element through ``np.memmap``'s Python-level
subclass hooks; for a large vocabulary that is most of the load (Gemma 3's 262k tokens: about 34 s
per read on 2 cores). A plain ndarray view of the same mapping reads identically at a fraction of it.
transformers' GGUF loading builds its own reader, so :func:`transformers_reads_plainly` hands it
this one for the duration of a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np


class PlainArrayReader(gguf.GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.memmap) -> None:
        self._data = value.view(np.ndarray)


def open_gguf(path: Path) -> PlainArrayReader:
    # Copy-on-write mapping: writable arrays for torch.from_numpy, and the file is never touched.
    return PlainArrayReader(path, mode="c")


@contextlib.contextmanager
def transformers_reads_plainly() -> Iterator[None]:
    """transformers imports ``gguf.GGUFReader`` by name inside its loaders: give it the plain one
    (at start-up only: the swap is process-wide while it lasts)."""
    original = gguf.GGUFReader
    gguf.GGUFReader = PlainArrayReader
    try:
        yield
    finally:
        gguf.GGUFReader = original
