"""FastLaunch: which launches reuse a compiled kernel, with which arguments, and its launch contract.

The compiled path needs CUDA; here a stand-in JIT function records what Triton's own path and the
compiled kernel's launcher are given (the GPU identity tests run the real kernels through it)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from kernels.triton_ops import _launch, attention, gemv, kv_store, norm_rope, row_argmax


def _kernel(x_ptr, n, stride, flag_value, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):
    pass


class FakeCompiled:
    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata, self.calls = object(), object(), calls

    def run(self, *launch):
        self.calls.append(("compiled", self, launch))


class FakeJIT:
    """What FastLaunch uses of a JITFunction: fn, params and ``[grid](*args, **kwargs)``."""

    def __init__(self, fn, do_not_specialize=()) -> None:
        self.fn = fn
        self.params = [
            SimpleNamespace(name=p.name, default=p.default, is_const=False,
                            do_not_specialize=p.name in do_not_specialize, do_not_specialize_on_alignment=False)
            for p in inspect.signature(fn).parameters.values()
        ]
        self.calls: list = []
        self.compiled: list[FakeCompiled] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            self.compiled.append(FakeCompiled(self.calls))
            return self.compiled[-1]
        return run


@pytest.fixture
def compiled_path(monkeypatch):
    """The launch path as on a GPU: not interpreted, stream 7 of device 0."""
    monkeypatch.setattr(_launch, "_INTERPRETED", False)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_reuses_the_compiled_kernel_per_specialization(compiled_path):
    if _launch._specialize is None:
        pytest.skip("this Triton has no native_specialize_impl: every launch takes Triton's path")
    fn = FakeJIT(_kernel)
    kernel = _launch.FastLaunch(fn)
    x = torch.zeros(64, dtype=torch.bfloat16)
    kernel[(4,)](x, 32, 16, 2, BLOCK=64, num_warps=4)
    assert fn.calls == [("triton", (4,), (x, 32, 16, 2), dict(BLOCK=64, num_warps=4))]
    y = torch.zeros(64, dtype=torch.bfloat16)  # another tensor of the same specialization
    kernel[(5, 2)](y, 48, 32, 3, BLOCK=64, num_warps=4)
    # the launcher gets a 3-d grid, the stream, and every argument in order, the constexprs' too
    assert fn.calls[-1] == ("compiled", fn.compiled[0], (
        5, 2, 1, 7, fn.compiled[0].function, fn.compiled[0].packed_metadata, None, None, None, y, 48, 32, 3, 64, 3,
    ))
    specializations = [
        ((x[1:], 32, 16, 2), dict(BLOCK=64, num_warps=4)),  # not 16-byte aligned
        ((x.float(), 32, 16, 2), dict(BLOCK=64, num_warps=4)),  # another dtype
        ((x, 33, 16, 2), dict(BLOCK=64, num_warps=4)),  # not a multiple of 16
        ((x, 32, 1, 2), dict(BLOCK=64, num_warps=4)),  # 1: a constant to Triton
        ((x, 2**33, 16, 2), dict(BLOCK=64, num_warps=4)),  # int64
        ((x, 32, 16, 2.0), dict(BLOCK=64, num_warps=4)),  # a float
        ((x, 32, 16, 2), dict(BLOCK=128, num_warps=4)),  # another constexpr
        ((x, 32, 16, 2), dict(BLOCK=64, num_warps=8)),  # another launch option
        ((x, 32, 16, 2), dict(BLOCK=64, MODE=3, num_warps=4)),  # the default named: another key, same kernel
    ]
    for args, kwargs in specializations:
        before = len(fn.compiled)
        kernel[(1,)](*args, **kwargs)
        assert fn.calls[-1] == ("triton", (1,), args, kwargs), (args, kwargs)
        kernel[(1,)](*args, **kwargs)
        assert fn.calls[-1][:2] == ("compiled", fn.compiled[before]), (args, kwargs)
    assert fn.calls[-1][2][-2:] == (64, 3)


def test_do_not_specialize_is_kept(compiled_path):
    if _launch._specialize is None:
        pytest.skip("this Triton has no native_specialize_impl")
    fn = FakeJIT(_kernel, do_not_specialize=("n",))
    kernel = _launch.FastLaunch(fn)
    x = torch.zeros(64)
    kernel[(1,)](x, 32, 16, 2, BLOCK=64)
    kernel[(1,)](x, 33, 16, 2, BLOCK=64)  # n is not specialized: the same kernel
    assert [c[0] for c in fn.calls] == ["triton", "compiled"]


def test_hooks_and_the_interpreter_take_tritons_path(compiled_path, monkeypatch):
    fn = FakeJIT(_kernel)
    kernel = _launch.FastLaunch(fn)
    x = torch.zeros(64)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    kernel[(1,)](x, 32, 16, 2, BLOCK=64)
    kernel[(1,)](x, 32, 16, 2, BLOCK=64)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(_launch, "_INTERPRETED", True)
    kernel[(1,)](x, 32, 16, 2, BLOCK=64)
    assert [c[0] for c in fn.calls] == ["triton"] * 3


def test_launch_contract():
    kernel = _launch.FastLaunch(FakeJIT(_kernel))
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="4 runtime arguments positionally, got 3"):
        kernel[(1,)](x, 1, 2, BLOCK=4)
    with pytest.raises(TypeError, match=r"pass \['flag_value'\] positionally"):
        kernel._check_args((x, 1, 2, 3), dict(flag_value=3, BLOCK=4))

    def mixed(x_ptr, BLOCK: tl.constexpr, n):
        pass

    with pytest.raises(TypeError, match="runtime parameters must all come before its constexprs"):
        _launch.FastLaunch(FakeJIT(mixed))


def test_the_op_kernels_launch_through_it():
    kernels = [attention._decode_attention_kernel, attention._decode_reduce_kernel,
               attention._prefill_attention_kernel, gemv._gemv_kernel, kv_store._store_kv_kernel,
               norm_rope._rms_norm_kernel, norm_rope._rotary_kernel, norm_rope._silu_and_mul_kernel,
               row_argmax._argmax_kernel]
    assert all(isinstance(k, _launch.FastLaunch) for k in kernels)
