"""What the op wrappers' launches share: the multiprocessor count that sizes their grids,
programmatic dependent launch, and the arrival counters of kernels whose last program merges."""

from __future__ import annotations

import functools

import torch

from kernels.triton_ops._checks import _check

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
