"""The CPU's few-row product of int8 weights (``int8_gemv.c`` beside this file), compiled at first
use by the C compiler (``$CC``, else ``cc``) for the CPU it runs on and loaded with ctypes.

torch's int8 weight-pack kernel streams SmolLM2's int8 weights at a third of their bandwidth at
one row on an AVX2 CPU; this kernel widens each weight in registers and multiplies fp32 rows,
reading the weights once for every row of ``x`` (``benchmarks/cpu_profile.py matmul``). Without a
compiler ``load()`` returns None and the weight-pack kernel serves (logged once).

The library is built into ``$XDG_CACHE_HOME/kvgate`` (default ``~/.cache/kvgate``) under a name
that hashes the source, the flags and the compiler's version, written to a temporary file and
renamed, so processes building it together do not clash. Its OpenMP is torch's own runtime
(``libgomp.so.1``, loaded with torch before this library): one thread pool, sized by
``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("engine.int8_gemv")

SOURCE = Path(__file__).with_name("int8_gemv.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate"


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"int8_gemv-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=True)
            os.replace(tmp, library)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return library


@functools.cache
def load() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``gemv(x, w, scale)``: ``x [M, K]`` fp32 contiguous, ``w [N, K]`` int8 contiguous, ``scale
    [N]`` fp32 -> ``x @ (w * scale[:, None]).T`` ``[M, N]`` fp32; None where it cannot be built."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("int8_gemv_unavailable", reason=f"no C compiler ({compiler})")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        log.warning("int8_gemv_unavailable", reason=detail.strip()[-500:])
        return None
    kernel = library.int8_gemv
    kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    kernel.restype = None

    def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        (rows, k), n = x.shape, w.shape[0]
        out = torch.empty(rows, n)
        kernel(x.data_ptr(), w.data_ptr(), scale.data_ptr(), out.data_ptr(), rows, n, k, torch.get_num_threads())
        return out

    return gemv
