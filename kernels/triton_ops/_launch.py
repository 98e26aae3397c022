"""What the op wrappers' launches share: the multiprocessor count that sizes their grids,
programmatic dependent launch, and the arrival counters of kernels whose last program merges."""

from __future__ import annotations

import functools
import inspect

import torch
from triton import knobs

from kernels.triton_ops._checks import _INTERPRETED, _check

_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# Split-K decode aims for this many programs per multiprocessor (see decode_num_splits).
_DECODE_PROGRAMS_PER_SM = 4
# The interpreter has no multiprocessors; a small count still exercises split-K on tiny shapes.
_INTERPRETER_NUM_SMS = 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pdl_args(device: torch.device) -> dict:
    """USE_PDL (and the launch option) of a kernel that waits on its predecessor with
    ``gdc_wait``: programmatic dependent launch, on sm_90 and newer, lets it start (and load what
    does not depend on the previous kernel) while that one finishes. The GEMV and the fused decode
    let the next kernel launch before their own wait (the GEMV once its first weight tiles are
    issued), so that the next kernel's weights stream in while they compute: on
    the H200, SmolLM2's batch-1 graph replay went from 0.492 to 0.456 ms (GEMV) and 0.427 ms (both),
    Llama 3 8B's from 4.071 to 4.040 ms (benchmarks/results/gpu_bench_pdl_trigger_h200.jsonl; a
    layer probed alone in kernels_bench had found a trigger right after the wait slower)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return dict(USE_PDL=True, launch_pdl=True)
    return dict(USE_PDL=False)


# Per device: the arrival counters of the kernels whose last program merges the others' partials
# (split-K decode_attention: one per (seq, kv head); argmax: one per row).
_ARRIVAL_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_ARRIVAL_COUNTERS = 1024


def _arrival_counters(device: torch.device, needed: int, op: str) -> torch.Tensor:
    """The device's arrival counters (``needed`` of them for this launch): zeroed once, then left
    at 0 by every launch (its last program resets them), so no launch needs a memset and CUDA
    graph replays find them ready. There are ``_MIN_ARRIVAL_COUNTERS``, and at least
    ``_DECODE_PROGRAMS_PER_SM * num_sms``: decode_num_splits splits only grids of fewer
    (seq, kv head) pairs. Shared by every launch on the device: two launches must not run at
    once (on two streams)."""
    counters = _ARRIVAL_COUNTERS.get(device)
    if counters is None:
        _check(
            device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
            lambda: f"{op}'s counters would be allocated inside a CUDA graph capture: "
            "call it once on the device before capturing",
        )
        count = max(_MIN_ARRIVAL_COUNTERS, _DECODE_PROGRAMS_PER_SM * _num_sms(device))
        counters = torch.zeros(count, dtype=torch.int32, device=device)
        _ARRIVAL_COUNTERS[device] = counters
    _check(
        needed <= counters.numel(),
        lambda: f"{op} needs {needed} arrival counters, more than the {counters.numel()} there are",
    )
    return counters


# --- the launch path of eager steps --------------------------------------------------------------

try:  # what Triton's own binder calls for each runtime argument (triton 3.6 and 3.7)
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.backends.compiler import BaseBackend as _SpecializeBackend
except ImportError:  # another Triton: every launch takes Triton's own path
    _specialize = None


def _runtime_params(fn) -> tuple[inspect.Parameter, ...]:
    """The parameters of the ``triton.jit`` function ``fn`` that are not ``tl.constexpr``; they must
    all come before the constexprs (the launch contract of :class:`FastLaunch`)."""
    params = tuple(inspect.signature(fn.fn).parameters.values())
    constexpr = ["constexpr" in str(p.annotation) for p in params]
    runtime = constexpr.index(True) if True in constexpr else len(params)
    if any(not c for c in constexpr[runtime:]):
        raise TypeError(f"{fn.fn.__name__}: its runtime parameters must all come before its constexprs")
    return params[:runtime]


class FastLaunch:
    """A ``triton.jit`` kernel launched as ``kernel[grid](*runtime_args, **constexprs_and_options)``,
    through the compiled kernel's launcher once Triton's own path has compiled (or found) it for the
    arguments' specialization. Triton's ``JITFunction.run`` builds the bound arguments, its cache key,
    the launch metadata and reads its knobs on every call: 25-60 us of host time a launch, 181 of them
    in an eager SmolLM2 step (benchmarks/results/step_phases_h100.jsonl). Here the key is what Triton
    keys its compiled kernels on: each runtime argument's specialization (Triton's own
    ``native_specialize_impl`` with the kernel's own flags), the constexprs and launch options by
    name, and the device; anything else (the interpreter, launch hooks, another Triton) takes
    Triton's own path. Contract, checked on every launch: the runtime arguments are passed
    positionally, all of them, and the constexprs and options by keyword."""

    def __init__(self, fn) -> None:
        self.fn = fn
        runtime = _runtime_params(fn)
        self._num_runtime = len(runtime)
        self._names = tuple(p.name for p in runtime)
        # per runtime argument: Triton's (is_const, specialize, align) flags for native_specialize_impl
        self._flags: tuple[tuple[bool, bool, bool], ...] | None = None
        # key -> (compiled kernel, the constexpr values after the runtime arguments)
        self._compiled: dict[tuple, tuple[object, tuple]] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return functools.partial(self._launch, grid)

    def _check_args(self, args: tuple, kwargs: dict) -> None:
        if len(args) != self._num_runtime:
            raise TypeError(f"{self.fn.fn.__name__} takes its {self._num_runtime} runtime arguments positionally, "
                            f"got {len(args)}")
        named = set(kwargs) & set(self._names)
        if named:
            raise TypeError(f"{self.fn.fn.__name__}: pass {sorted(named)} positionally")

    def _launch(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        if len(args) != self._num_runtime or _INTERPRETED:
            self._check_args(args, kwargs)
        hook = knobs.runtime.launch_enter_hook  # 3.7: a HookChain, empty unless a profiler added to it
        hooked = hook is not None and bool(getattr(hook, "calls", True))
        if _INTERPRETED or _specialize is None or _current_stream is None or hooked:
            self.fn[grid](*args, **kwargs)
            return
        flags = self._flags
        if flags is None:
            flags = self._flags = tuple(
                (kp.is_const, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment)
                for kp in self.fn.params[:self._num_runtime]
            )
        device = torch.cuda.current_device()
        key = (device, *[_specialize(_SpecializeBackend, a, c, s, al) for a, (c, s, al) in zip(args, flags)],
               *kwargs.items())
        compiled = self._compiled.get(key)
        if compiled is None:
            self._check_args(args, kwargs)
            kernel = self.fn[grid](*args, **kwargs)  # Triton's own path: compiles if it must, launches
            if getattr(kernel, "function", None) is not None and hasattr(kernel, "packed_metadata"):
                constexprs = tuple(kwargs.get(kp.name, kp.default) for kp in self.fn.params[self._num_runtime:])
                self._compiled[key] = (kernel, constexprs)
            return
        kernel, constexprs = compiled
        dims = len(grid)
        kernel.run(
            grid[0], grid[1] if dims > 1 else 1, grid[2] if dims > 2 else 1, _current_stream(device),
            kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs,
        )


def fast_launch(fn) -> FastLaunch:
    """Decorator under ``@triton.jit``: see :class:`FastLaunch`."""
    return FastLaunch(fn)
