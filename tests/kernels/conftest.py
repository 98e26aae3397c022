"""Fixtures of the Triton kernel tests: the interpreter on while they run, and the interpreted op set."""

from __future__ import annotations

import pytest
import triton
from kernel_cases import INTERPRETED
from triton.runtime.interpreter import InterpretedFunction

from kernels import triton_ops
from kernels.triton_ops import _checks


@pytest.fixture(scope="module", autouse=True)
def interpreter_env():
    """TRITON_INTERPRET=1 while each test module runs (triton reads it again at first launch)."""
    with pytest.MonkeyPatch.context() as mp:
        if INTERPRETED:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture
def ops():
    """The Triton op set, interpreted: its kernels run on CPU tensors."""
    if not INTERPRETED:
        pytest.skip("CUDA is present: the gpu tests run the compiled kernels")
    if not (_checks._INTERPRETED and isinstance(triton.language.zeros, InterpretedFunction)):
        pytest.fail(
            "triton was imported before kernel_cases could turn the interpreter on; "
            "run pytest with TRITON_INTERPRET=1 in the environment"
        )
    return triton_ops
