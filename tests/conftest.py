"""Suite-wide settings."""

import os

# Several processes (pytest, engine and gateway subprocesses) share the CPU cores: spinning
# OpenMP workers made small ops 10x slower. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Without CUDA, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
