"""A CPU engine's host: KV pages committed as they are written, the process's RSS, and the
OpenMP threads its ops run on."""

from __future__ import annotations

import mmap
import os
import time

import structlog
import torch

log = structlog.get_logger("engine.cpu")


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


# How often a CPU engine re-measures the cores other processes keep busy (seconds of stepping).
GOVERNOR_WINDOW_S = 0.5


def workers_spin() -> bool:
    """Whether idle OpenMP workers spin before they sleep: libgomp's GOMP_SPINCOUNT where it is set
    (it wins over OMP_WAIT_POLICY), else every OMP_WAIT_POLICY but PASSIVE."""
    spin_count = os.environ.get("GOMP_SPINCOUNT")
    if spin_count is not None:
        return spin_count.strip() != "0"
    return os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"


def _busy_cpu_seconds(cpus: set[int]) -> float | None:
    """Seconds the CPUs ``cpus`` have spent busy since boot, every process's work and the
    hypervisor's steal counted (/proc/stat; None where there is none)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Keeps a CPU engine's spinning OpenMP workers off cores that other processes need.

    A worker that spins at a barrier while another process holds the core its partner runs on
    stalls every parallel region: beside one CPU-bound process, a 2-thread engine decoded SmolLM2 at
    1.9 tok/s instead of 29.4 (one thread: 17.8). So every ``GOVERNOR_WINDOW_S`` the engine counts
    the cores other processes kept busy (its CPUs' busy time from /proc/stat minus its own CPU
    time) and runs its ops on the cores left, rounded, between 1 and the threads it started with;
    a change takes two windows that agree. The CPUs are those of the process's affinity: a cgroup
    CPU quota is not seen.

    :meth:`tick` runs on the thread that runs the ops (torch's thread count is per thread), each
    step and, in a served engine, each window while idle: a request that arrives while another
    process keeps a core busy finds the threads already sized (right after a vLLM CPU server's
    burst on the same cores, SmolLM2's first token took 1.0 s, and 0.15-0.23 s so).
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = self.threads = max_threads
        self._cpus = os.sched_getaffinity(0)
        self._mark = self._sample()
        self._wanted = max_threads

    def _sample(self) -> tuple[float, float, float | None]:
        """(now, this process's CPU seconds, its CPUs' busy seconds)"""
        return time.monotonic(), time.process_time(), _busy_cpu_seconds(self._cpus)

    def tick(self) -> None:
        """Re-measure and re-size when a window has passed since the last measure."""
        if time.monotonic() - self._mark[0] < GOVERNOR_WINDOW_S:
            return
        (wall0, ours0, busy0), sample = self._mark, self._sample()
        self._mark = sample
        wall, ours, busy = sample[0] - wall0, sample[1] - ours0, sample[2]
        if busy is None or busy0 is None:  # no /proc/stat
            return
        others = max(busy - busy0 - ours, 0.0) / wall  # cores other processes kept busy
        wanted = min(max(int(len(self._cpus) - others + 0.5), 1), self.max_threads)
        if wanted != self.threads and wanted == self._wanted:
            log.debug("cpu_threads", threads=wanted, was=self.threads, other_cores=round(others, 2))
            torch.set_num_threads(wanted)
            self.threads = wanted
        self._wanted = wanted
