"""Agent conversations: how much of the reusable prefix each turn hits, with and without
exact-position prefix entries, in the same run.

Each conversation has eight turns over a shared ~2.6K-token system prompt, with ~1.3K new tokens
per turn (the previous answer, then a long user or tool message). Prompts are SmolLM2's ChatML
rendered in token space ("<|im_start|>" = 1, "<|im_end|>" = 2, role tokens, "\\n" = 198) with the
cache boundaries a gateway sends: the end of the system message and the end of the last message.
Conversation c starts in round c, so later ones meet the system prompt in cache. In thinking mode
the first ``--reasoning-tokens`` of each answer are reasoning that the next turn's history leaves
out, so the reuse ends where the previous prompt did.

The numbers are cache accounting, not speed: the engine (EngineCore, stepped directly) runs the
tiny dummy shape with random weights on the CPU; its tokens only make the answers. Per turn,
``reusable`` is the longest prefix of the prompt whose KV an earlier round computed (same salt),
less the one token that is always computed; ``hit`` is what the engine served from cache (capped at
``reusable``: prompts of one round may also meet each other's first tokens).

Prints one JSON line per (block size, mode, entries on/off). Goal: with entries, at most 1 % of the
reusable prefix recomputed.
Run: .venv/bin/python benchmarks/agent_turns.py

``--think-time``: the host-memory KV tier, in wall-clock time. The conversations run at once, each
turn sent a random think time (uniform, mean ``--think-seconds``) after the previous answer ended,
on a KV pool sized to hold ``--pool-fraction`` of all the conversations' tokens, so a conversation
comes back after the pool evicted it. The same conversations run with the host tier off, then on
(``--host-kv-cache-gib``: by default large enough for every block), in one process. Per mode: the
hit rate of the reusable prefix and the TTFT p50/p90 of later turns (from the turn's arrival to
its first token, queueing included). Goal: hit rate >= 95 % with the tier on, later-turn TTFT p90
>= 3x better. On the H200 (a real model's shape with dummy weights; ``--num-layers`` keeps that
shape's per-layer ratio of KV bytes to FLOPs with fewer layers):
  python benchmarks/agent_turns.py --think-time --device cuda --shape llama3-8b --num-layers 8 \
      --conversations 64
Dry run on the CPU: python benchmarks/agent_turns.py --think-time --conversations 6 --turns 3 \
      --system-tokens 200 --turn-tokens 100 --think-seconds 0.05
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import DUMMY_CONFIGS, EngineConfig
from engine.core import EngineCore
from engine.logs import configure_logging
from engine.models.loader import load_model
from engine.protocol import GenerateRequest, SamplingParams
from engine.warmup import warmup
from kernels import load_ops
from loadtest.stamp import emit

IM_START, IM_END, NL = 1, 2, 198
ROLES = {"system": (9690,), "user": (4093,), "assistant": (520, 9531)}
GENERATION_PROMPT = [IM_START, *ROLES["assistant"], NL]
SALT = "tenant-0"


def render(messages: list[tuple[str, list[int]]]) -> tuple[list[int], list[int]]:
    """ChatML prompt with the generation prompt, and the boundaries a gateway sends."""
    ids: list[int] = []
    ends: list[int] = []
    for role, content in messages:
        ids += [IM_START, *ROLES[role], NL, *content, IM_END, NL]
        ends.append(len(ids))
    return ids + GENERATION_PROMPT, sorted({ends[0], ends[-1]})


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 40000) for _ in range(n)]


def run(core: EngineCore, args: argparse.Namespace, thinking: bool) -> list[dict]:
    """All conversations, round by round; returns one record per turn."""
    rng = random.Random(args.seed)  # the same conversations for every configuration
    system = words(rng, args.system_tokens)
    chats = [[("system", system)] for _ in range(args.conversations)]
    last_output: list[list[int]] = [[] for _ in range(args.conversations)]
    computed: list[np.ndarray] = []  # KV the engine computed in earlier rounds
    records = []
    for round_ in range(args.conversations + args.turns - 1):
        active = [c for c in range(args.conversations) if 0 <= round_ - c < args.turns]
        prompts = {}
        for c in active:
            if last_output[c]:
                # the last sampled token stands for the <|im_end|> that the template writes itself
                chats[c].append(("assistant", last_output[c][args.reasoning_tokens if thinking else 0 : -1]))
            new = args.turn_tokens - (len(chats[c][-1][1]) if len(chats[c]) > 1 else 0)
            chats[c].append(("user", words(rng, max(new + rng.randint(-100, 100), 1))))
            prompt, boundaries = render(chats[c])
            prompts[c] = prompt
            sampling = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
            core.add_request(GenerateRequest(f"c{c}-t{round_ - c}", prompt, sampling, SALT, boundaries))
        outputs: dict[str, list[int]] = {}
        cached: dict[str, int] = {}
        while core.has_work():
            for frame in core.step():
                outputs.setdefault(frame.request_id, []).extend(frame.token_ids)
                cached[frame.request_id] = frame.num_cached_tokens
        for c in active:
            rid = f"c{c}-t{round_ - c}"
            prompt = np.asarray(prompts[c])
            reusable = min(max((common_prefix_len(prompt, k) for k in computed), default=0), len(prompt) - 1)
            records.append({"turn": round_ - c, "prompt": len(prompt), "reusable": reusable, "cached": cached[rid]})
            last_output[c] = outputs[rid]
        computed += [np.asarray(prompts[c] + last_output[c][:-1]) for c in active]
    return records


def reused_tokens(records: list[dict]) -> tuple[int, int]:
    """(tokens a turn could reuse, of those the engine served from its cache), summed over turns."""
    return sum(r["reusable"] for r in records), sum(min(r["cached"], r["reusable"]) for r in records)


def summarize(records: list[dict], block_size: int, thinking: bool, entries: bool, seconds: float) -> dict:
    follow_ups = [r for r in records if r["turn"] > 0]
    reusable, hit = reused_tokens(records)
    recomputed = [r["reusable"] - min(r["cached"], r["reusable"]) for r in records]
    return {
        "bench": "agent_turns",
        "block_size": block_size,
        "mode": "thinking" if thinking else "plain",
        "exact_position_entries": entries,
        "turns": len(records),
        "prompt_tokens": sum(r["prompt"] for r in records),
        "reusable_tokens": reusable,
        "hit_tokens": hit,
        "hit_fraction_of_reusable": round(hit / reusable, 5),
        "recomputed_fraction_of_reusable": round(1 - hit / reusable, 5),
        "recomputed_reusable_tokens_per_turn": round(sum(recomputed) / len(records), 1),
        "recomputed_reusable_tokens_per_follow_up_turn": round(
            sum(r["reusable"] - min(r["cached"], r["reusable"]) for r in follow_ups) / len(follow_ups), 1
        ),
        "max_recomputed_reusable_tokens": max(recomputed),
        "computed_prompt_tokens_per_turn": round(sum(r["prompt"] - r["cached"] for r in records) / len(records), 1),
        "goal_met": 1 - hit / reusable <= 0.01,
        "seconds": round(seconds, 1),
    }


def think_time_run(core: EngineCore, args: argparse.Namespace) -> list[dict]:
    """Every conversation's turns in wall-clock time, each sent a think time after the previous
    answer; returns one record per turn with its TTFT."""
    rng = random.Random(args.seed)
    system = words(rng, args.system_tokens)
    chats = [[("system", system)] for _ in range(args.conversations)]
    turn_of = [0] * args.conversations
    computed: list[np.ndarray | None] = [None] * args.conversations  # KV of each one's last turn
    clock = time.perf_counter
    start = clock()
    # conversations start spread over one mean think time, as sessions already running would be
    due = {c: start + c * args.think_seconds / args.conversations for c in range(args.conversations)}
    in_flight: dict[str, dict] = {}
    records = []
    sampling = SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    system_end = 0  # tokens of the rendered system message, once a turn computed them
    while due or in_flight:
        now = clock()
        for c in [c for c, at in due.items() if at <= now]:
            del due[c]
            new = args.turn_tokens - (len(chats[c][-1][1]) if len(chats[c]) > 1 else 0)
            chats[c].append(("user", words(rng, max(new + rng.randint(-100, 100), 1))))
            prompt, boundaries = render(chats[c])
            if computed[c] is not None:
                reusable = common_prefix_len(np.asarray(prompt), computed[c])
            else:
                reusable = system_end
            rid = f"c{c}-t{turn_of[c]}"
            in_flight[rid] = {"conversation": c, "turn": turn_of[c], "prompt": prompt, "arrival": clock(),
                              "reusable": min(reusable, len(prompt) - 1), "tokens": []}
            core.add_request(GenerateRequest(rid, prompt, sampling, SALT, boundaries))
        if not core.has_work():
            if due:
                time.sleep(max(0.0, min(due.values()) - clock()))
            continue
        for frame in core.step():
            turn = in_flight[frame.request_id]
            if frame.token_ids and not turn["tokens"]:
                turn["ttft"] = clock() - turn["arrival"]
            turn["tokens"] += frame.token_ids
            turn["cached"] = frame.num_cached_tokens
            if frame.finish_reason is None:
                continue
            del in_flight[frame.request_id]
            c, answer = turn["conversation"], turn["tokens"]
            computed[c] = np.asarray(turn["prompt"] + answer[:-1])
            system_end = len(render(chats[c][:1])[0]) - len(GENERATION_PROMPT)
            records.append({"prompt": len(turn["prompt"]),
                            **{k: turn[k] for k in ("turn", "reusable", "cached", "ttft")}})
            chats[c].append(("assistant", answer[:-1]))
            turn_of[c] += 1
            if turn_of[c] < args.turns:
                due[c] = clock() + rng.uniform(0.5, 1.5) * args.think_seconds
    return records


def summarize_think_time(records: list[dict], core: EngineCore, host_gib: float, seconds: float) -> dict:
    later = sorted(r["ttft"] for r in records if r["turn"] > 0)
    reusable, hit = reused_tokens(records)
    stats = core.stats()
    return {
        "bench": "agent_turns_think_time",
        "host_kv_cache_gib": host_gib,
        "turns": len(records),
        "prompt_tokens": sum(r["prompt"] for r in records),
        "reusable_tokens": reusable,
        "hit_tokens": hit,
        "hit_fraction_of_reusable": round(hit / reusable, 4),
        "later_turn_ttft_p50_s": round(float(np.percentile(later, 50)), 4),
        "later_turn_ttft_p90_s": round(float(np.percentile(later, 90)), 4),
        "first_turn_ttft_p50_s": round(float(np.median([r["ttft"] for r in records if r["turn"] == 0])), 4),
        "kv_pool_tokens": stats.num_total_blocks * stats.block_size,
        "host_tier_tokens": stats.num_host_blocks * stats.block_size,
        "host_loaded_blocks": stats.host_loaded_blocks,
        "host_offloaded_blocks": stats.host_offloaded_blocks,
        "preemptions": stats.num_preemptions,
        "seconds": round(seconds, 1),
    }


def think_time_main(args: argparse.Namespace) -> None:
    """The host tier off, then on, over the same conversations (see the module docstring)."""
    device = torch.device(args.device)
    base = DUMMY_CONFIGS[args.shape]
    max_len = args.system_tokens + (args.turns + 1) * (args.turn_tokens + 200 + args.answer_tokens)
    shape = dataclasses.replace(base, name=f"{base.name}-{args.num_layers or base.num_layers}l",
                                num_layers=args.num_layers or base.num_layers, max_position_embeddings=max_len)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(shape.to_json())
        f.flush()
        ops = load_ops("torch" if device.type == "cpu" else "triton")
        model, config = load_model(f.name, "dummy", device, dtype, ops)
    # every conversation's unique tokens, and the shared system prompt once
    per_conversation = args.turns * (args.turn_tokens + args.answer_tokens + 8)
    total_tokens = args.conversations * per_conversation + args.system_tokens
    # at least one whole conversation (a tiny dry run's quarter may hold less)
    num_blocks = math.ceil(max(total_tokens * args.pool_fraction, max_len) / args.block_size)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    host_gib = args.host_kv_cache_gib or float(f"{1.2 * total_tokens * per_token / 2**30:.3g}")
    for gib in (0.0, host_gib):
        engine_config = EngineConfig(
            model=config.name, device=args.device, dtype=str(dtype).removeprefix("torch."),
            block_size=args.block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.conversations, enforce_eager=True, host_kv_cache_gib=gib,
        )
        core = EngineCore.from_model(engine_config, model, config)
        warmup(core)  # kernels compiled before the clock runs, for either mode
        start = time.perf_counter()
        records = think_time_run(core, args)
        core.check_integrity()
        emit(**summarize_think_time(records, core, gib, time.perf_counter() - start),
             shape=shape.name, layers=shape.num_layers, conversations=args.conversations, turns_each=args.turns,
             think_seconds=args.think_seconds,
             device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        del core
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="16,64,256")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2600)
    parser.add_argument("--turn-tokens", type=int, default=1300, help="new prompt tokens per turn (about)")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--reasoning-tokens", type=int, default=48, help="of the answer, in thinking mode")
    parser.add_argument("--kv-tokens", type=int, default=2**17, help="KV pool size in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the same accounting, sooner)")
    parser.add_argument("--think-time", action="store_true", help="the host KV tier run (see above)")
    parser.add_argument("--think-seconds", type=float, default=2.0, help="mean think time between turns")
    parser.add_argument("--pool-fraction", type=float, default=0.25, help="of all conversations' tokens")
    parser.add_argument("--host-kv-cache-gib", type=float, default=0.0, help="0: room for every block")
    parser.add_argument("--shape", default="tiny", help="dummy model shape (engine.config.DUMMY_CONFIGS)")
    parser.add_argument("--num-layers", type=int, default=0, help="of the shape (0: all)")
    parser.add_argument("--block-size", type=int, default=16, help="with --think-time")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="with --think-time")
    args = parser.parse_args()
    configure_logging("WARNING")  # stdout holds the measurements
    if args.think_time:
        think_time_main(args)
        return

    max_len = args.system_tokens + (args.turns + 1) * (args.turn_tokens + 200) + args.answer_tokens
    shape = dataclasses.replace(DUMMY_CONFIGS["tiny"], name="tiny-long", max_position_embeddings=max_len)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(shape.to_json())
        f.flush()
        ops = load_ops("torch" if args.device == "cpu" else "triton")
        model, config = load_model(f.name, "dummy", torch.device(args.device), torch.float32, ops)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # peaky logits: answers vary, so no answer matches its reasoning by chance
    for block_size in map(int, args.block_sizes.split(",")):
        for thinking in (False, True):
            for entries in (False, True):
                engine_config = EngineConfig(
                    model=config.name, device=args.device, dtype="float32", block_size=block_size,
                    num_kv_blocks=args.kv_tokens // block_size,
                    max_num_batched_tokens=2048, max_entries_fraction=0.25 if entries else 0.0,
                )
                core = EngineCore.from_model(engine_config, model, config)
                start = time.perf_counter()
                records = run(core, args, thinking)
                emit(**summarize(records, block_size, thinking, entries, time.perf_counter() - start))


if __name__ == "__main__":
    main()
