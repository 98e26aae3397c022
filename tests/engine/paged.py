"""A toy paged KV cache that drives a model through chunked prefill and decode in tests."""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Hashable

import torch

from engine.attention import AttentionMetadata
from engine.config import DUMMY_CONFIGS, ModelConfig
from engine.core import EngineCore
from engine.models.llama import LlamaForCausalLM
from engine.protocol import GenerateRequest, SamplingParams
from engine.scheduler import ScheduledSeq
from kernels import load_ops


def peaky_tiny(
    device: str = "cpu", ops: str = "torch", max_position_embeddings: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The tiny dummy shape with peaky weights: greedy ties are unlikely, sampling differs visibly."""
    torch.manual_seed(0)
    config = DUMMY_CONFIGS["tiny"]
    if max_position_embeddings is not None:
        config = dataclasses.replace(config, max_position_embeddings=max_position_embeddings)
    model = LlamaForCausalLM(config, load_ops(ops), device=device, dtype=dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model, config


def mixed_step(core: EngineCore, decode_lengths: list[int], prompt_length: int, tokens: range, seed: int,
               warm_steps: int) -> list[ScheduledSeq]:
    """The step ``core`` schedules once prompts of ``decode_lengths`` decode (after ``warm_steps``
    steps) and a prompt of ``prompt_length`` tokens joins them; token ids drawn from ``tokens``."""
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, length in enumerate(decode_lengths):
        core.add_request(GenerateRequest(f"d{i}", [rng.choice(tokens) for _ in range(length)], sampling))
    for _ in range(warm_steps):
        core.step()
    core.add_request(GenerateRequest("p", [rng.choice(tokens) for _ in range(prompt_length)], sampling))
    return core.scheduler.schedule().scheduled


def generate(
    core: EngineCore, prompts: list[list[int]], sampling: SamplingParams, prefix: str = "p"
) -> list[list[int]]:
    """Each prompt's tokens, ``core`` stepped until idle; every block is free again at the end."""
    for i, prompt in enumerate(prompts):
        core.add_request(GenerateRequest(f"{prefix}{i}", prompt, sampling))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for frame in core.step():
            out.setdefault(frame.request_id, []).extend(frame.token_ids)
    assert core.check_integrity().used == 0
    return [out[f"{prefix}{i}"] for i in range(len(prompts))]


def clone(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its own weights, sharing its op set (a module: not copyable)."""
    return copy.deepcopy(model, memo={id(model.ops): model.ops})


class PagedKV:
    """A paged KV cache for one model, with blocks handed out from a shuffled pool so that every
    block table is non-contiguous. ``step`` feeds the next tokens of any number of sequences as
    one varlen batch, the way the runner does."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
            for _ in range(config.num_layers)
        ]
        self.block_size = block_size
        self.device = device
        shuffled = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free_blocks = shuffled.tolist()
        self.block_tables: dict[Hashable, list[int]] = {}
        self.num_computed: dict[Hashable, int] = {}

    def batch(
        self, chunks: dict[Hashable, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, attn)`` for the given new tokens per sequence (new ids start
        a sequence); allocates blocks and advances each sequence's computed length."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, tokens in chunks.items():
            table = self.block_tables.setdefault(seq, [])
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            while len(table) * bs < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += (table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + len(tokens))
            self.num_computed[seq] = end
        tables = [self.block_tables[seq] for seq in chunks]
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        attn = AttentionMetadata(
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=starts,
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            attn,
        )

    @torch.inference_mode()
    def step(self, model: torch.nn.Module, chunks: dict[Hashable, list[int]]) -> torch.Tensor:
        """Run ``model`` on the chunks; fp32 logits of each chunk's last token, in chunk order."""
        input_ids, positions, attn = self.batch(chunks)
        hidden = model(input_ids, positions, attn, self.kv_caches)
        last_rows = torch.tensor(attn.query_start_loc_cpu[1:], device=self.device) - 1
        return model.compute_logits(hidden[last_rows])
