"""A child process's life tied to its parent's (Linux's PR_SET_PDEATHSIG): the engines a gateway
spawns, and an engine's own process. Imports nothing beyond the standard library: the gateway
imports it."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, parent_pid: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere nothing),
    and exit now if ``parent_pid`` is no longer its parent (it died before the prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
