"""kvgate's CPU kernels (``cpu_kernels.c`` beside this file), compiled at first use by the C
compiler (``$CC``, else ``cc``) for the CPU it runs on and called through ctypes (which lets go
of the GIL):

- ``int8_gemv``: the few-row product of int8 weights. torch's int8 weight-pack kernel streams
  SmolLM2's int8 weights at a third to a half of their bandwidth at one row; this one widens each
  weight in registers and multiplies fp32 rows, reading the weights once for every row of ``x``
  (``benchmarks/cpu_profile.py matmul``).
- ``rms_norm``, ``silu_and_mul``, ``decode_attention``: a decode step's small ops in fp32, one call
  each where torch's eager ops take 4-40 (each a few microseconds of dispatch on 2 cores: more
  than the arithmetic of a batch-1 step), with the semantics of ``kernels.reference``'s.
- ``int8_decoder_stack``: a Llama decoder's decode step (every layer over the kernels above, then
  the final norm) in one call and one OpenMP region, for ``engine.models.cpu.Int8DecoderStack``.

Each output is computed in a fixed order whatever the batch or the thread count. Without a
compiler ``load()`` returns None and torch's ops serve (logged once).

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
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("engine.cpu_kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "int8_gemv": [_P] * 4 + [_I64] * 3 + [ctypes.c_int],
    "rms_norm": [_P] * 3 + [_F] + [_P] * 2 + [_I64] * 2 + [ctypes.c_int],
    "silu_and_mul": [_P] * 2 + [_I64] * 2 + [ctypes.c_int],
    "decode_attention": [_P] * 3 + [_I64] + [_P] * 6 + [_I64] + [_P] + [_F] + [_I64] + [_P] + [_I64] * 5
    + [ctypes.c_int],
    "int8_decoder_stack": [_P, _I64, _P, _F] + [_P] * 6 + [_I64, _P, _F] + [_I64] * 7 + [ctypes.c_int],
}


class Int8Layer(ctypes.Structure):
    """One Llama decoder layer for ``int8_decoder_stack``: its norms' weights, its int8 projections and
    their fp32 per-row scales, its KV cache pages and its sliding window (0: none)."""

    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_scale",
                                        "o_scale", "gate_up_scale", "down_scale", "k_cache", "v_cache")]
    _fields_ += [("window", _I64)]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate"


def _build(compiler: str, source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"cpu_kernels-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                           check=True)
            os.replace(tmp, library)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return library


class CpuKernels:
    """The compiled kernels over torch tensors (fp32, on the CPU; shapes as the callers check them)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        for name, argtypes in SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
        self.lib = library

    def int8_gemv(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` fp32 contiguous, ``w [N, K]`` int8 contiguous, ``scale [N]`` fp32 ->
        ``x @ (w * scale[:, None]).T`` ``[M, N]`` fp32."""
        (rows, k), n = x.shape, w.shape[0]
        out = torch.empty(rows, n)
        self.lib.int8_gemv(x.data_ptr(), w.data_ptr(), scale.data_ptr(), out.data_ptr(), rows, n, k,
                           torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``kernels.reference.rms_norm`` for contiguous fp32 rows ``x [T, H]``."""
        out = torch.empty_like(x)
        new_residual = x if residual is None else torch.empty_like(x)
        self.lib.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
                          out.data_ptr(), new_residual.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``kernels.reference.silu_and_mul`` for contiguous fp32 rows ``x [T, 2d]``."""
        rows, d = x.shape[0], x.shape[1] // 2
        out = x.new_empty(rows, d)
        self.lib.silu_and_mul(x.data_ptr(), out.data_ptr(), rows, d, torch.get_num_threads())
        return out

    def decode_attention(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
    ) -> torch.Tensor:
        """``kernels.reference.decode_attention`` without q/k norms for fp32 q/k/v rows of one stride
        (views of a fused qkv: each head's ``head_dim`` values contiguous), an fp32 cache, int64
        positions and slots, int32 tables and lengths (contiguous)."""
        num_seqs, num_heads, head_dim = q.shape
        out = q.new_empty(num_seqs, num_heads, head_dim)
        self.lib.decode_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), positions.data_ptr(), cos_sin_cache.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), scale, window, out.data_ptr(), num_seqs, num_heads,
            k.shape[1], head_dim, k_cache.shape[1], torch.get_num_threads(),
        )
        return out

    def int8_decoder_stack(
        self, layers: ctypes.Array, final_norm: torch.Tensor, eps: float, x: torch.Tensor, positions: torch.Tensor,
        cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        scale: float, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int, block_size: int,
    ) -> torch.Tensor:
        """A Llama decoder's decode step: ``layers`` (an array of :class:`Int8Layer`) and the final
        norm over the embedded tokens ``x [S, H]`` (fp32), with ``decode_attention``'s batch
        layout; the final hidden states ``[S, H]``, bit for bit those of the model's ops run one by one."""
        out = torch.empty_like(x)
        self.lib.int8_decoder_stack(
            layers, len(layers), final_norm.data_ptr(), eps, x.data_ptr(), out.data_ptr(), positions.data_ptr(),
            cos_sin_cache.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), scale, x.shape[0], x.shape[1], num_heads, num_kv_heads, head_dim, intermediate_size,
            block_size, torch.get_num_threads(),
        )
        return out


@functools.cache
def load(source: Path = SOURCE) -> CpuKernels | None:
    """The kernels, built and loaded once; None where they cannot be built. ``source``: another version
    of ``cpu_kernels.c`` (benchmarks compare one against this one in the same process)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("cpu_kernels_unavailable", reason=f"no C compiler ({compiler})")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler, source))))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        log.warning("cpu_kernels_unavailable", reason=detail.strip()[-500:])
        return None
