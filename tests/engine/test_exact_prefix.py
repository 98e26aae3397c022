"""Exact-position prefix entries end to end: multi-turn chats resume mid-page with the outputs of a
cold prefill, at block sizes 16 to 256; page contents stay right under eviction and preemption."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from paged import peaky_tiny

from engine.config import EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.model_runner import LaunchedStep
from engine.protocol import GenerateRequest, SamplingParams
from engine.scheduler import SampledToken
from engine.warmup import warmup

# SmolLM2's ChatML in token space: "<|im_start|>", "<|im_end|>", "\n" and the role names.
IM_START, IM_END, NL = 1, 2, 198
ROLES = {"system": (9690,), "user": (4093,), "assistant": (520, 9531)}
GENERATION_PROMPT = [IM_START, *ROLES["assistant"], NL]


def render(messages: list[tuple[str, list[int]]]) -> tuple[list[int], list[int]]:
    """The prompt with its generation prompt, and the cache boundaries a gateway sends: where the
    system message and where the last message end."""
    ids: list[int] = []
    ends: list[int] = []
    for role, content in messages:
        ids += [IM_START, *ROLES[role], NL, *content, IM_END, NL]
        ends.append(len(ids))
    boundaries = ends[:1] if messages[0][0] == "system" and len(messages) > 1 else []
    return ids + GENERATION_PROMPT, boundaries + ends[-1:]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Chat:
    """One conversation. With ``reasoning`` > 0 it is in thinking mode: that many leading output
    tokens are the reasoning, which the next turn's history leaves out."""

    rid: str
    salt: str | None
    messages: list[tuple[str, list[int]]]
    start: int  # the round of its first turn
    reasoning: int = 0
    turns: list[dict] = field(default_factory=list)  # prompt, boundaries, output, cached

    def next_prompt(self, user: list[int]) -> tuple[list[int], list[int]]:
        if self.turns:
            output = self.turns[-1]["output"]
            # the last sampled token stands for the <|im_end|> the template writes itself
            self.messages.append(("assistant", output[self.reasoning : -1]))
        self.messages.append(("user", user))
        return render(self.messages)


def make_chats(rng: random.Random, n: int, system_len: tuple[int, int]) -> list[Chat]:
    """Two system prompts; chats 2k and 2k+1 share one and start in rounds 0 and 1; every sixth
    chat is another tenant's and every third one thinks."""
    systems = [[rng.randrange(300, 12000) for _ in range(rng.randint(*system_len))] for _ in range(2)]
    return [
        Chat(f"c{i}", "tenant-b" if i % 6 == 5 else "tenant-a", [("system", systems[i // 2 % 2])], start=i % 2,
             reasoning=3 if i % 3 == 2 else 0)
        for i in range(n)
    ]


def run_rounds(core: EngineCore, chats: list[Chat], rng: random.Random, num_turns: int, user_len, max_tokens) -> None:
    """``num_turns`` turns of every chat, from its start round on; every request of a round is
    submitted at once (they batch)."""
    for round_ in range(num_turns + 1):
        active = [c for c in chats if c.start <= round_ < c.start + num_turns]
        for chat in active:
            user = [rng.randrange(300, 12000) for _ in range(rng.randint(*user_len))]
            prompt, boundaries = chat.next_prompt(user)
            sampling = SamplingParams(max_tokens=rng.choice(max_tokens), temperature=0.0, ignore_eos=True)
            core.add_request(GenerateRequest(f"{chat.rid}-{len(chat.turns)}", prompt, sampling, chat.salt, boundaries))
            chat.turns.append({"prompt": prompt, "boundaries": boundaries, "output": [], "cached": None})
        by_id = {f"{c.rid}-{len(c.turns) - 1}": c.turns[-1] for c in active}
        while core.has_work():
            for frame in core.step():
                turn = by_id[frame.request_id]
                turn["output"] += frame.token_ids
                turn["cached"] = frame.num_cached_tokens
            core.check_integrity()
    assert core.check_integrity().used == 0


def check_cached_tokens(chats: list[Chat]) -> None:
    """Nothing was evicted, so every turn resumes where the cache can: right after the previous
    turn's last computed token when the answer comes back verbatim, at least at the end of the
    previous prompt's last message in thinking mode, at least at the end of the system prompt for
    a chat's first turn after a chat of its tenant with its system prompt; never across tenants
    (chats starting in the same round may or may not meet, as their prefills interleave)."""
    for chat in chats:
        peers = [o.start for o in chats if o is not chat and (o.salt, o.messages[0]) == (chat.salt, chat.messages[0])]
        for t, turn in enumerate(chat.turns):
            if t == 0:
                system_end = turn["boundaries"][0]  # then "<|im_start|>user\n" is shared too
                low = system_end if any(start < chat.start for start in peers) else 0
                high = system_end + 3 if chat.start in peers or low else 0
                assert low <= turn["cached"] <= high, (chat.rid, t)
                continue
            prev = chat.turns[t - 1]
            computed = prev["prompt"] + prev["output"][:-1]
            if chat.reasoning:
                shared = common_prefix_len(turn["prompt"], computed)
                assert prev["boundaries"][-1] <= turn["cached"] <= shared, (chat.rid, t)
            else:
                assert turn["cached"] == len(computed), (chat.rid, t)


def cold_outputs(core: EngineCore, chats: list[Chat]) -> dict[str, list[int]]:
    """Every prompt of every chat again, with no prefix caching, all in one batch."""
    for chat in chats:
        for t, turn in enumerate(chat.turns):
            sampling = SamplingParams(max_tokens=len(turn["output"]), temperature=0.0, ignore_eos=True)
            core.add_request(GenerateRequest(f"{chat.rid}-{t}", turn["prompt"], sampling, chat.salt))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for frame in core.step():
            assert frame.num_cached_tokens == 0
            out.setdefault(frame.request_id, []).extend(frame.token_ids)
    return out


def assert_same_outputs(chats: list[Chat], cold: dict[str, list[int]]) -> None:
    turns = {f"{c.rid}-{t}": turn["output"] for c in chats for t, turn in enumerate(c.turns)}
    assert len(turns) == len(cold)
    mismatches = [rid for rid, output in turns.items() if cold[rid] != output]
    assert mismatches == [], [(rid, turns[rid], cold[rid]) for rid in mismatches]


# --- the tiny random model: 24 chats at block sizes 16, 64, 128 and 256 ------------------------

@pytest.fixture(scope="module")
def tiny_long():
    return peaky_tiny(max_position_embeddings=4096)


def tiny_core(tiny_long, **overrides) -> EngineCore:
    model, config = tiny_long
    settings = {"max_num_batched_tokens": 512, **overrides}
    return EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config)


@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_resumed_chats_match_cold_prefill_on_the_tiny_model(tiny_long, block_size):
    rng = random.Random(block_size)
    chats = make_chats(rng, 6, system_len=(150, 500))
    core = tiny_core(tiny_long, block_size=block_size, num_kv_blocks=2**17 // block_size)
    run_rounds(core, chats, rng, num_turns=4, user_len=(20, 200), max_tokens=(8, 40))
    check_cached_tokens(chats)
    assert any(turn["cached"] % block_size for chat in chats for turn in chat.turns)
    assert core.stats().num_position_entries > 0
    cold = cold_outputs(tiny_core(tiny_long, block_size=block_size, enable_prefix_caching=False), chats)
    assert_same_outputs(chats, cold)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
def test_resumed_chats_match_cold_prefill_on_cuda(block_size):
    """Triton kernels (fp32), decode CUDA graphs replayed over copied pages."""
    model, config = peaky_tiny("cuda", "triton", max_position_embeddings=4096)
    rng = random.Random(block_size)
    chats = make_chats(rng, 6, system_len=(150, 500))

    def core(**overrides) -> EngineCore:
        settings = {"device": "cuda", "dtype": "float32", "block_size": block_size, "max_num_seqs": 16,
                    "max_num_batched_tokens": 512, "num_kv_blocks": 2**17 // block_size}
        return EngineCore.from_model(EngineConfig(model="tiny", **settings, **overrides), model, config)

    resumed = core()
    warmup(resumed)
    assert resumed.runner.decode_graphs is not None
    run_rounds(resumed, chats, rng, num_turns=4, user_len=(20, 200), max_tokens=(8, 40))
    check_cached_tokens(chats)
    assert_same_outputs(chats, cold_outputs(core(enable_prefix_caching=False), chats))


def test_copy_blocks_copies_every_layer_gathering_before_scattering(tiny_long):
    runner = tiny_core(tiny_long, block_size=16, num_kv_blocks=8).runner
    for k, v in runner.kv_caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.copy_blocks([(1, 5), (5, 6)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        for now, old in ((k, k0), (v, v0)):
            assert torch.equal(now[5], old[1]) and torch.equal(now[6], old[5])
            assert torch.equal(now[[0, 1, 2, 3, 4, 7]], old[[0, 1, 2, 3, 4, 7]])


def test_fraction_flag_is_validated():
    with pytest.raises(ValueError, match="max_entries_fraction"):
        EngineConfig(model="tiny", max_entries_fraction=1.5)


# --- the real SmolLM2 (fp32, CPU) -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
def test_resumed_chats_match_cold_prefill_on_smollm2(smollm2, block_size):
    model, config = smollm2
    rng = random.Random(100 + block_size)
    chats = make_chats(rng, 3, system_len=(60, 120))

    def core(**overrides) -> EngineCore:
        settings = {"block_size": block_size, "max_num_batched_tokens": 256, "num_kv_blocks": 4096 // block_size}
        return EngineCore.from_model(EngineConfig(model="smollm2", **settings, **overrides), model, config)

    resumed = core()
    run_rounds(resumed, chats, rng, num_turns=3, user_len=(10, 40), max_tokens=(6,))
    check_cached_tokens(chats)
    assert any(turn["cached"] % block_size for chat in chats for turn in chat.turns)
    assert_same_outputs(chats, cold_outputs(core(enable_prefix_caching=False), chats))


# --- page contents under eviction, preemption and aborts --------------------------------------

class ContentRunner:
    """Stands in for the ModelRunner: each KV slot holds the identity of the token prefix (and
    salt) whose KV it would hold, so reading a stale page, a wrong copy or another tenant's page
    fails at once. The sampled token is a function of the prefix. No model runs."""

    def __init__(self, config: ModelConfig, block_size: int, max_model_len: int):
        self.config = config
        self.device, self.dtype, self.max_model_len = torch.device("cpu"), torch.float32, max_model_len
        self.block_size = block_size
        self.slots: list[list[int | None]] = []
        self.prefix_ids: dict[tuple[str, int], list[int]] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.slots = [[None] * self.block_size for _ in range(num_blocks)]

    def _identities(self, seq) -> list[int]:
        ids = self.prefix_ids.setdefault(seq.key, [])
        for p in range(len(ids), seq.num_tokens):
            ids.append(hash((ids[-1] if ids else seq.salt, seq.all_token_ids[p])))
        return ids

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pages = [list(self.slots[src]) for src, _ in pairs]
        for (_, dst), page in zip(pairs, pages):
            self.slots[dst] = page

    def launch(self, scheduled, previous=None) -> LaunchedStep:
        return LaunchedStep.on_host(self.execute(scheduled), graphed=False)

    def execute(self, scheduled) -> list[SampledToken]:
        bs = self.block_size
        sampled = []
        for seq, num_new in scheduled:
            ids = self._identities(seq)
            start = seq.num_computed_tokens
            held = [self.slots[seq.block_ids[p // bs]][p % bs] for p in range(start)]
            assert held == ids[:start], f"{seq.request_id} reads KV it never computed"
            for p in range(start, start + num_new):
                self.slots[seq.block_ids[p // bs]][p % bs] = ids[p]
            if start + num_new == seq.num_tokens:
                sampled.append(SampledToken(seq, 300 + ids[-1] % 1000, None))
        return sampled


def test_pages_stay_right_under_eviction_preemption_and_aborts(tiny_long):
    bs = 8
    settings = {"block_size": bs, "num_kv_blocks": 96, "max_num_batched_tokens": 64, "max_num_seqs": 6}
    core = EngineCore(EngineConfig(model="tiny", **settings), ContentRunner(tiny_long[1], bs, 4096))
    rng = random.Random(7)
    chats = make_chats(rng, 10, system_len=(20, 60))
    idle = list(chats)
    running: dict[str, Chat] = {}
    partial_hits = aborts = most_entries = 0
    for step in range(600):
        if idle and (not running or rng.random() < 0.3):
            chat = idle.pop(rng.randrange(len(idle)))
            if len(render(chat.messages)[0]) > 250:  # a new conversation: prompts fit the pool
                del chat.messages[1:], chat.turns[:]
            prompt, boundaries = chat.next_prompt([rng.randrange(300, 12000) for _ in range(rng.randint(3, 40))])
            boundaries.append(rng.randrange(1, len(prompt) + 1))  # one anywhere, out of order
            rid = f"{chat.rid}-{step}"
            sampling = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)
            core.add_request(GenerateRequest(rid, prompt, sampling, chat.salt, boundaries))
            chat.turns.append({"prompt": prompt, "boundaries": boundaries, "output": [], "cached": 0})
            running[rid] = chat
        if running and rng.random() < 0.02:
            rid = rng.choice(list(running))
            core.abort(rid)
            aborts += 1
            running[rid].turns[-1]["output"].append(0)  # the turn ends with whatever it had
            idle.append(running.pop(rid))
        for frame in core.step():
            chat = running[frame.request_id]
            chat.turns[-1]["output"] += frame.token_ids
            if frame.finish_reason:
                partial_hits += frame.num_cached_tokens % bs != 0
                idle.append(running.pop(frame.request_id))
        core.check_integrity()
        most_entries = max(most_entries, len(core.kv.entries))
    assert partial_hits > 10 and aborts > 0 and core.scheduler.num_preemptions > 0
    assert most_entries == core.kv.entries.cap  # the cap was reached and held
