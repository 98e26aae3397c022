"""The Triton op set: ``kernels.KernelOps`` (contracts and layouts there) as Triton kernels.

Each op is a host wrapper that checks shapes, dtypes, strides and devices, then launches one or
two kernels. Lengths (tokens, sequence lengths, query lengths) are runtime values: only head
counts, head dims, the KV block size, tile shapes and power-of-two buckets are compile-time
constants, so a new prompt length never triggers a recompilation.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the kernels run on CPU
tensors; the interpreter computes ``tl.dot`` on bf16 storage incorrectly, so there every dot is
done in fp32.
"""

from kernels.reference import rope_cos_sin_cache
from kernels.triton_ops.attention import paged_attention
from kernels.triton_ops.fused_decode import decode_attention
from kernels.triton_ops.gemv import linear, norm_linear
from kernels.triton_ops.kv_store import store_kv
from kernels.triton_ops.norm_rope import rms_norm, rotary_embedding, silu_and_mul
from kernels.triton_ops.row_argmax import argmax, sample_argmax

__all__ = [
    "store_kv",
    "paged_attention",
    "decode_attention",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "silu_and_mul",
    "linear",
    "norm_linear",
    "argmax",
    "sample_argmax",
]
