"""The Triton op set as a whole: the shared device check, load_ops, and the tiny model on it."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import BACKENDS, KernelOps, load_ops, reference, triton_ops
from kernels.triton_ops import _checks


@pytest.mark.parametrize("backend", BACKENDS)
def test_op_sets_have_the_kernel_ops_signatures(backend):
    """Every KernelOps op, with the Protocol's parameters (names, kinds, defaults, annotations)
    and return annotation."""
    ops = load_ops(backend)
    names = [name for name, member in vars(KernelOps).items() if inspect.isfunction(member) and name[0] != "_"]
    assert len(names) == 11
    for name in names:
        contract = inspect.signature(getattr(KernelOps, name))
        without_self = contract.replace(parameters=list(contract.parameters.values())[1:])
        assert inspect.signature(getattr(ops, name)) == without_self, name


def test_compiled_kernels_reject_cpu_tensors(ops, monkeypatch):
    monkeypatch.setattr(_checks, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors, got x on cpu"):
        ops.silu_and_mul(torch.randn(4, 8))


def model_step(model, caches, tables: list[list[int]], starts: list[int], chunks: list[list[int]], block_size: int):
    """One varlen step of ``model`` over the chunks (sequence ``i`` resumes at ``starts[i]`` on
    block table ``tables[i]``): fp32 logits of each chunk's last token."""
    from engine.attention import AttentionMetadata

    ids, positions, slots, seq_lens, query_start = [], [], [], [], [0]
    for table, start, chunk in zip(tables, starts, chunks):
        ids += chunk
        positions += range(start, start + len(chunk))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(chunk))]
        seq_lens.append(start + len(chunk))
        query_start.append(query_start[-1] + len(chunk))
    width = max(map(len, tables))
    attn = AttentionMetadata(
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), seq_lens_cpu=seq_lens, query_start_loc_cpu=query_start,
        max_query_len=max(map(len, chunks)), max_seq_len=max(seq_lens),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(positions), attn, caches)
        return model.compute_logits(hidden[torch.tensor(query_start[1:]) - 1])


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_model_on_triton_ops_matches_torch_ops(ops, architecture):
    """The tiny model on the Triton ops (cuBLAS with the norm and SiLU kernels for a prefill,
    the GEMVs and decode_attention for decode rows) gives the torch ops' logits step by step;
    as Qwen3, with the q/k norms inside rotary_embedding and decode_attention."""
    import dataclasses

    from engine.config import DUMMY_CONFIGS
    from engine.models import build_model

    config, block_size = dataclasses.replace(DUMMY_CONFIGS["tiny"], architecture=architecture), 16
    torch.manual_seed(0)
    theirs = build_model(config, reference)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = build_model(config, ops)
    ours.load_state_dict(theirs.state_dict())
    shape = (8, block_size, config.num_kv_heads, config.head_dim)
    caches = {m: [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)] for m in (ours, theirs)}
    tables = [[3, 0], [5]]
    prompts = [list(range(100, 120)), list(range(300, 309))]
    steps = [([0, 0], prompts)]  # a prefill of both (29 rows), then decode steps of both (2 rows) and of one
    steps += [([20 + i, 9 + i], [[7 + i], [8 + i]]) for i in range(3)]
    for starts, chunks in steps + [([23], [[11]])]:
        rows = tables[: len(chunks)]
        expected = model_step(theirs, caches[theirs], rows, starts, chunks, block_size)
        torch.testing.assert_close(model_step(ours, caches[ours], rows, starts, chunks, block_size), expected,
                                   rtol=1e-4, atol=1e-4)


def test_load_ops_triton():
    ops = load_ops("triton")
    assert ops is triton_ops
    names = (
        "store_kv", "paged_attention", "decode_attention", "rms_norm", "rope_cos_sin_cache",
        "rotary_embedding", "silu_and_mul", "linear", "norm_linear", "argmax",
    )
    for name in names:
        assert callable(getattr(ops, name)), name
    assert ops.rope_cos_sin_cache is reference.rope_cos_sin_cache
