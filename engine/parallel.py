"""Tensor parallelism across processes: one process per rank, started and watched by rank 0.

Rank 0 is the engine's own process: it schedules, serves HTTP and samples. Each other rank is a
child process (``spawn``) that loads the model, keeps its shard (:func:`engine.models.tp.shard_model`)
and its own KV cache with the same block ids, then follows rank 0: before each call into the model
rank 0 sends every follower, over its pipe, a small typed message (:data:`Message`) with the
call's inputs — a step's token ids, positions and block tables; the rows whose logits are wanted
(their hidden states are broadcast: every rank's vocabulary shard needs them); page copies; the
pool's size — and the followers run the same call, so the collectives inside line up. Decode
steps run through CUDA graphs captured per rank (:class:`RankDecodeGraphs`): rank 0 names the graph
and the graph itself broadcasts its inputs. Everything the scheduler decides (prefix caching,
exact-position entries, KV events) stays on rank 0.

Failure: collectives time out after COLLECTIVE_TIMEOUT; a watchdog thread on rank 0 waits on the
children's process sentinels and reports a death at once (the engine turns it into a failed
engine: health red, open requests ended with an error); a follower whose pipe closes (rank 0
gone) exits. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import numpy as np
import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.core import EngineCore, context_limit, resolve_dtype
from engine.cuda_graphs import CarriedTokens, DecodeGraphs, DecodeOutput, decode_buckets
from engine.logs import configure_logging
from engine.model_runner import ModelRunner
from engine.models.tp import TensorParallelLM, shard_model
from engine.request import Sequence
from engine.sampler import DirectDraw
from engine.structured import Grammars
from kernels import load_ops

log = structlog.get_logger("engine.parallel")

# A collective waits this long for the other ranks: long enough for the slowest rank's load (the
# barrier before serving) and a long prefill, short enough that a wedged rank fails the engine.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_STOP_JOIN_S = 10.0


# --- rank 0 -> followers ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AllocateKV:
    num_blocks: int


@dataclass(frozen=True, slots=True)
class CopyBlocks:
    pairs: list[tuple[int, int]]  # (src, dst) pages, as ModelRunner.copy_blocks


@dataclass(frozen=True, slots=True)
class GroupTables:
    """One KV layer group's block tables ``[seqs, width]`` int32 and slots ``[tokens]`` int64."""

    block_tables: np.ndarray
    slot_mapping: np.ndarray


@dataclass(frozen=True, slots=True)
class Forward:
    """One forward's inputs. ``kv_blocks``: the size of the cache it runs on — the pool, except
    for the profiling run before the pool exists, which runs on a scratch cache of that size."""

    input_ids: np.ndarray
    positions: np.ndarray
    seq_lens: list[int]
    query_start: list[int]
    max_query_len: int
    max_seq_len: int
    groups: tuple[GroupTables, ...]
    kv_blocks: int


@dataclass(frozen=True, slots=True)
class Logits:
    """``compute_logits`` of ``num_rows`` hidden rows, which rank 0 broadcasts next."""

    num_rows: int


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    """Build the decode graphs (captured on CUDA) as rank 0 does, in the same order."""


@dataclass(frozen=True, slots=True)
class DecodeReplay:
    """A decode step through the graph ``key`` (bucket, context bound); its inputs come by broadcast.
    ``seq_lens``: the padded lengths, which only the CPU's uncaptured path reads."""

    key: tuple[int, int]
    seq_lens: list[int]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Message = AllocateKV | CopyBlocks | Forward | Logits | CaptureGraphs | DecodeReplay | Stop


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the ``rank``-th GPU from ``device``'s index on."""
    base = torch.device(device)
    return base if base.type == "cpu" else torch.device("cuda", (base.index or 0) + rank)


def _forward_message(input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                     kv_blocks: int) -> Forward:
    groups = attn.groups or (attn,)
    return Forward(
        input_ids.cpu().numpy(), positions.cpu().numpy(), list(attn.seq_lens_cpu), list(attn.query_start_loc_cpu),
        attn.max_query_len, attn.max_seq_len,
        tuple(GroupTables(g.block_tables.cpu().numpy(), g.slot_mapping.cpu().numpy()) for g in groups), kv_blocks,
    )


def _forward_inputs(msg: Forward, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    def metadata(group: GroupTables) -> AttentionMetadata:
        return AttentionMetadata(
            block_tables=torch.from_numpy(group.block_tables).to(device),
            seq_lens=torch.tensor(msg.seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(msg.query_start, dtype=torch.int32, device=device),
            slot_mapping=torch.from_numpy(group.slot_mapping).to(device),
            seq_lens_cpu=msg.seq_lens,
            query_start_loc_cpu=msg.query_start,
            max_query_len=msg.max_query_len,
            max_seq_len=msg.max_seq_len,
        )

    groups = tuple(metadata(g) for g in msg.groups)
    attn = groups[0]
    if len(groups) > 1:
        attn.groups = groups
    return torch.from_numpy(msg.input_ids).to(device), torch.from_numpy(msg.positions).to(device), attn


class Followers:
    """Rank 0's pipes to the other ranks."""

    def __init__(self, conns: list[Connection]):
        self.conns = conns

    def send(self, msg: Message) -> None:
        """To every follower; raises OSError (BrokenPipeError) when one is gone."""
        for conn in self.conns:
            conn.send(msg)

    def stop(self) -> None:
        """Tell every follower still reachable to stop."""
        for conn in self.conns:
            try:
                conn.send(Stop())
            except OSError:  # gone already
                pass


class LeaderLM(nn.Module):
    """Rank 0's model: tells the followers each call's inputs, then runs its own shard."""

    def __init__(self, model: TensorParallelLM, followers: Followers):
        super().__init__()
        self.model = model
        self.config = model.config
        self.ops = model.ops
        self.followers = followers

    def forward(self, input_ids, positions, attn, kv_caches) -> torch.Tensor:
        self.followers.send(_forward_message(input_ids, positions, attn, kv_caches[0][0].shape[0]))
        return self.model(input_ids, positions, attn, kv_caches)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.followers.send(Logits(hidden.shape[0]))
        rows = hidden.contiguous()
        dist.broadcast(rows, src=0, group=self.model.group)
        return self.model.compute_logits(rows, out)


class RankDecodeGraphs(DecodeGraphs):
    """One rank's decode graphs over its shard. Each graph begins by broadcasting rank 0's static
    inputs (token ids, positions, slots, lengths, block tables: captured with the rest), so a
    follower replays the same graph knowing only which one; rank 0's tell the followers first."""

    def __init__(self, runner: ModelRunner, model: TensorParallelLM, followers: Followers | None):
        super().__init__(
            model, runner.kv_caches, runner.device, runner.block_size, runner.max_blocks_per_seq,
            decode_buckets(runner.max_num_seqs), capture=runner.device.type == "cuda",
            num_groups=len(runner.layout.group_windows),
        )
        self.followers = followers
        self.group = model.group

    def _forward(self, batch_size: int, context_bound: int, seq_lens_cpu: list[int]) -> DecodeOutput:
        dist.broadcast(self._inputs, src=0, group=self.group)
        return super()._forward(batch_size, context_bound, seq_lens_cpu)

    def run(self, seqs: list[Sequence], carried: CarriedTokens | None = None,
            draw: DirectDraw | None = None) -> DecodeOutput:
        """Rank 0's step: as DecodeGraphs.run, the followers told which graph first (the graph's
        broadcast of the input ids carries the tokens of ``carried`` to them)."""
        seq_lens = [seq.num_computed_tokens + 1 for seq in seqs]
        key = self.graph_key(len(seqs), max(seq_lens))
        self.followers.send(DecodeReplay(key, seq_lens + [0] * (key[0] - len(seqs))))
        return super().run(seqs, carried, draw)

    def replay(self, msg: DecodeReplay) -> None:
        """A follower's step: the graph rank 0 replays."""
        if self.capture_graphs:
            self._graphs[msg.key].replay()
        else:  # the CPU: the padded buffers run eagerly
            self._forward(*msg.key, msg.seq_lens)


def _capture(graphs: RankDecodeGraphs) -> int:
    if not graphs.capture_graphs:
        return 0
    with torch.inference_mode():
        return graphs.capture()


class LeaderRunner(ModelRunner):
    """Rank 0's runner: the followers allocate and copy KV pages as it does (the same block ids)
    and build their decode graphs with it. On the CPU (tests) the graphs are the padded buffers
    run eagerly, with the same broadcasts."""

    def __init__(self, *args, followers: Followers, **kwargs):
        super().__init__(*args, **kwargs)
        self.followers = followers

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.followers.send(AllocateKV(num_blocks))
        super().allocate_kv_cache(num_blocks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.followers.send(CopyBlocks(pairs))
        super().copy_blocks(pairs)

    def capture_decode_graphs(self) -> int:
        self.followers.send(CaptureGraphs())
        self.decode_graphs = RankDecodeGraphs(self, self.model.model, self.followers)
        return _capture(self.decode_graphs)


# --- every rank --------------------------------------------------------------------------------
def _init_rank(config: EngineConfig, rank: int, address: str) -> tuple[dist.ProcessGroup, torch.device]:
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=address, rank=rank,
        world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return dist.group.WORLD, device


def _load_shard(config: EngineConfig, rank: int, group: dist.ProcessGroup,
                device: torch.device) -> tuple[TensorParallelLM, ModelConfig]:
    """The full model read on the CPU, this rank's shard kept and moved to ``device``. Dummy weights
    are drawn per shard (seeded by rank) after sharding an uninitialized model, whose untouched
    pages cost no memory: a shape larger than the host's memory (Llama-3-70B on two ranks) loads."""
    from engine.models import build_model
    from engine.models.loader import DUMMY_SEED, fill_dummy, load_dummy_config, load_model

    dtype, ops = resolve_dtype(config), load_ops(config.resolved_kernel_backend)
    if config.load_format == "dummy":
        model_config = load_dummy_config(config.model)
        model = build_model(model_config, ops, "cpu", dtype)
    else:
        model, model_config = load_model(config.model, config.load_format, "cpu", dtype, ops)
    shard = shard_model(model, config.tensor_parallel_size, rank, group).to(device)
    if config.load_format == "dummy":
        fill_dummy(shard, DUMMY_SEED + rank)
    log.info("tensor_parallel_shard", rank=rank, world_size=config.tensor_parallel_size, device=str(device),
             num_heads=shard.config.num_heads, num_kv_heads=shard.config.num_kv_heads,
             intermediate_size=shard.config.intermediate_size)
    return shard, model_config


def _runner(cls: type[ModelRunner], model: nn.Module, config: EngineConfig, shard_config: ModelConfig,
            full_config: ModelConfig, device: torch.device, **kwargs) -> ModelRunner:
    return cls(model, shard_config, device, resolve_dtype(config), config.block_size, config.max_num_seqs,
               context_limit(config, full_config), **kwargs)


def _follower_main(rank: int, config: EngineConfig, address: str, conn: Connection, log_level: str,
                   cpu_threads: int) -> None:
    """A follower rank's process: load, shard, then run what rank 0 sends until Stop or EOF. An
    error is logged and ends the process (rank 0's watchdog then fails the engine)."""
    configure_logging(log_level)
    structlog.contextvars.bind_contextvars(tp_rank=rank)
    torch.set_num_threads(cpu_threads)
    try:
        _follow(rank, config, address, conn)
    except Exception:
        log.exception("tensor_parallel_rank_failed", rank=rank)
        sys.exit(1)


def _follow(rank: int, config: EngineConfig, address: str, conn: Connection) -> None:
    group, device = _init_rank(config, rank, address)
    model, model_config = _load_shard(config, rank, group, device)
    runner = _runner(ModelRunner, model, config, model.config, model_config, device)
    graphs: RankDecodeGraphs | None = None
    dist.barrier(group)
    with torch.inference_mode():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone
                log.warning("tensor_parallel_leader_gone", rank=rank)
                break
            match msg:
                case Forward():
                    if not runner.kv_caches or runner.kv_caches[0][0].shape[0] != msg.kv_blocks:
                        runner.allocate_kv_cache(msg.kv_blocks)  # the profiling run's scratch cache
                    model(*_forward_inputs(msg, device), runner.kv_caches)
                case Logits(num_rows):
                    rows = torch.empty(num_rows, model_config.hidden_size, dtype=resolve_dtype(config), device=device)
                    dist.broadcast(rows, src=0, group=group)
                    model.compute_logits(rows)
                case AllocateKV(num_blocks):
                    runner.kv_pages = runner.kv_caches = []  # the scratch cache goes before the pool comes
                    runner.allocate_kv_cache(num_blocks)
                case CopyBlocks(pairs):
                    runner.copy_blocks(pairs)
                case CaptureGraphs():
                    graphs = RankDecodeGraphs(runner, model, None)
                    _capture(graphs)
                case DecodeReplay():
                    graphs.replay(msg)
                case Stop():
                    break
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelRanks:
    """Rank 0's side of a tensor-parallel engine: starts the followers, builds the core (rank 0's
    shard behind a :class:`LeaderRunner`), watches the followers and stops them.

    ``on_failure(exc)`` is called once, from the watchdog thread, when a follower dies before
    :meth:`close`. Not thread-safe apart from that callback.
    """

    def __init__(self, config: EngineConfig, on_failure: Callable[[BaseException], None] | None = None):
        if config.tensor_parallel_size < 2:
            raise ValueError("TensorParallelRanks needs tensor_parallel_size of at least 2")
        self.config = config
        self.on_failure = on_failure
        self._procs: list[mp.Process] = []
        self._followers = Followers([])
        self._closing = threading.Event()

    def build_core(self) -> EngineCore:
        """Start the followers and return rank 0's EngineCore once every rank holds its shard."""
        from engine.models.loader import load_tokenizer_info

        config = self.config
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the followers
        address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_follower_main, name=f"engine-tp-rank-{rank}", daemon=True,
                               args=(rank, config, address, child, log_level, torch.get_num_threads()))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._followers.conns.append(parent)
        threading.Thread(target=self._watch, name="engine-tp-watchdog", daemon=True).start()
        torch.manual_seed(config.seed)
        group, device = _init_rank(config, 0, address)
        model, model_config = _load_shard(config, 0, group, device)
        runner = _runner(LeaderRunner, LeaderLM(model, self._followers), config, model.config, model_config,
                         device, followers=self._followers)
        dist.barrier(group)
        info = load_tokenizer_info(config.model, config.load_format, model_config)
        return EngineCore(config, runner, None if info is None else Grammars(info))

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs, 1)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[ready[0]]
        exc = RuntimeError(f"tensor-parallel rank {rank} exited (code {self._procs[rank - 1].exitcode})")
        log.error("tensor_parallel_rank_died", rank=rank, exitcode=self._procs[rank - 1].exitcode)
        if self.on_failure is not None:
            self.on_failure(exc)

    def close(self) -> None:
        """Stop the followers (killed if they do not exit in time) and leave the process group."""
        self._closing.set()
        self._followers.stop()
        deadline = time.monotonic() + _STOP_JOIN_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()
