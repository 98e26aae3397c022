"""Host values to the device without waiting for it.

A step queues its work on the device while the previous step may still run there (overlapped
scheduling), so building its inputs must never synchronize: ``torch.tensor(values, device=cuda)``
copies from pageable memory and then waits for every kernel queued on the stream.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``; on CUDA copied from pinned memory without a
    stream sync (the pinned block is not reused before the copy is done)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
