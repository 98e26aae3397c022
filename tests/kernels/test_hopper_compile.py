"""Every kernel of the op set compiles for Hopper (sm_90) on this CPU: hopper_compile.py, in a process
of its own (there the kernels are compiled, not interpreted), with the ptxas of Triton's wheel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("hopper_compile.py")
ROOT = SCRIPT.parents[2]


def run_script(*args: str) -> str:
    """hopper_compile.py's output, run without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper():
    compiled = {name for line in run_script().splitlines() for name in line.partition(": ")[2].split(", ")}
    # every kernel of the op set has a case (a new one without fails here)
    kernels = {name for source in (ROOT / "kernels" / "triton_ops").glob("*.py")
               for name in re.findall(r"^@triton\.jit.*\ndef (_\w+_kernel)\(", source.read_text(), re.M)}
    assert len(kernels) >= 13 and compiled == kernels


@pytest.mark.slow
def test_resources_report_each_decode_kernel():
    """``--resources``: a JSON line per launch of each decode step case, with what ptxas decided."""
    records = [json.loads(line) for line in run_script("--resources").splitlines()]
    assert {(r["shape"], r["batch"]) for r in records} == {(s, b) for s in ("smollm2-135m", "qwen3-0.6b", "llama3-8b")
                                                          for b in (1, 64, 256)}
    for r in records:
        assert r["registers"] > 0 and r["programs_per_sm"] >= 1 and r["waves"] == round(
            r["programs"] / (132 * r["programs_per_sm"]), 2)
    fused = [r for r in records if r["kernel"] == "_fused_decode_kernel"]
    assert len(fused) == 9 and all(r["grid"][0] == r["batch"] for r in fused)  # a program row per sequence
