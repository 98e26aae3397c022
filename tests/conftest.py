"""Suite-wide settings."""

import os

import torch

# Without CUDA, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
