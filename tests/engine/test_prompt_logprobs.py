"""Prompt logprobs computed in the prefill equal HF transformers' log-softmax (fp32 CPU, SmolLM2), on a
cold prompt and on one whose prefix is cached; a chunked, recomputed or n > 1 request gets them once."""

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.prompt_logprobs import collect_prompt_logprobs
from engine.protocol import GenerateRequest, SamplingParams
from engine.request import Sequence
from engine.scheduler import ScheduledSeq

K = 3
PROMPT = [random.Random(7).randrange(300, 12000) for _ in range(90)]


def run(core: EngineCore, requests: list[GenerateRequest]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for req in requests:
        core.add_request(req)
    while core.has_work():
        for frame in core.step():
            entry = out.setdefault((frame.request_id, frame.index), {"tokens": [], "prompt": None, "cached": 0})
            entry["tokens"] += frame.token_ids
            entry["cached"] = max(entry["cached"], frame.num_cached_tokens)
            if frame.prompt_logprobs is not None:
                assert entry["prompt"] is None, "prompt logprobs come once"
                entry["prompt"] = frame.prompt_logprobs
        core.check_integrity()
    return out


def request(rid: str, prompt_logprobs: int | None, n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=n,
                                                       prompt_logprobs=prompt_logprobs))


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_gguf_model):
    with torch.inference_mode():
        logits = hf_gguf_model(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)


def test_a_recomputed_chunk_appends_only_what_is_missing():
    """After a preemption the prefill starts again at 0: the logprobs already collected stay, the rest
    follow, each the log-softmax of its row at the next prompt token."""
    vocab, prompt = 50, [3, 7, 1, 9, 4, 4, 0, 2, 8, 5]
    seq = Sequence("r", 0, prompt, SamplingParams(prompt_logprobs=2), None, [], None)
    hidden = torch.randn(len(prompt), vocab)
    reference = hidden.log_softmax(-1)
    collect_prompt_logprobs(lambda rows: rows, hidden[:4], [ScheduledSeq(seq, 4)])  # positions 0-3
    first = list(seq.prompt_logprobs)
    assert len(first) == 4 and seq.needs_prompt_logprobs
    collect_prompt_logprobs(lambda rows: rows, hidden, [ScheduledSeq(seq, len(prompt))])  # recomputed from 0
    assert seq.prompt_logprobs[:4] == first and len(seq.prompt_logprobs) == len(prompt) - 1
    assert not seq.needs_prompt_logprobs
    for pos, lp in enumerate(seq.prompt_logprobs):
        row = reference[pos]
        assert lp.logprob == pytest.approx(row[prompt[pos + 1]].item())
        assert lp.rank == int((row > row[prompt[pos + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
    sibling = Sequence("r", 1, prompt, SamplingParams(prompt_logprobs=2), None, [], None)
    assert not sibling.needs_prompt_logprobs  # sequence 0 alone computes them


def check(prompt_logprobs, reference: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) - 1
    for pos, lp in enumerate(prompt_logprobs):
        row = reference[pos]
        token = PROMPT[pos + 1]
        assert abs(lp.logprob - row[token].item()) < 1e-4
        assert lp.rank == int((row > row[token]).sum()) + 1
        assert len(lp.top) == k
        top_values, top_ids = row.topk(k)
        for (tid, value), ref in zip(lp.top, top_values.tolist()):
            assert abs(value - ref) < 1e-4 and abs(row[tid].item() - value) < 1e-4


@pytest.mark.slow
def test_prompt_logprobs_match_hf_cold_and_on_a_prefix_hit(smollm2, hf_prompt_logprobs):
    model, config = smollm2
    # a 32-token budget prefills the 90-token prompt in three chunks
    core = EngineCore.from_model(EngineConfig(model="smollm2", max_num_batched_tokens=32, num_kv_blocks=64),
                                 model, config)
    cold = run(core, [request("cold", K)])[("cold", 0)]
    assert cold["cached"] == 0
    check(cold["prompt"], hf_prompt_logprobs, K)

    plain = run(core, [request("plain", None)])[("plain", 0)]
    assert plain["cached"] >= 80 and plain["prompt"] is None  # the prompt is cached now

    # A hit: the request that asks for prompt logprobs recomputes the cached prefix, and is exact.
    hit = run(core, [request("hit", 0, n=2)])
    assert hit[("hit", 0)]["cached"] == 0
    check(hit[("hit", 0)]["prompt"], hf_prompt_logprobs, 0)
    assert hit[("hit", 1)]["prompt"] is None and hit[("hit", 1)]["cached"] >= 80  # the sibling reuses it
    assert hit[("hit", 0)]["tokens"] == cold["tokens"] == plain["tokens"]


def test_preempted_prefill_gives_the_same_prompt_logprobs_once():
    """A request asking for prompt logprobs is preempted mid-prefill (its own next chunk does not fit
    beside a long request), more than once; it recomputes from the start, never from the blocks it had
    cached, and its prompt logprobs equal those of an engine without pressure."""
    prompt = [random.Random(1).randrange(10, 500) for _ in range(100)]
    long_one = GenerateRequest("long", list(range(20, 170)), SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True))

    def engine(num_kv_blocks: int) -> EngineCore:
        config = EngineConfig(model="tiny", load_format="dummy", max_num_batched_tokens=32, num_kv_blocks=num_kv_blocks)
        return EngineCore.from_config(config)

    asked = GenerateRequest("asked", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                            prompt_logprobs=2))
    tight = engine(14)
    pressed = run(tight, [long_one, asked])[("asked", 0)]
    assert tight.scheduler.num_preemptions >= 2 and pressed["cached"] == 0
    free = run(engine(256), [asked])[("asked", 0)]
    assert len(pressed["prompt"]) == len(free["prompt"]) == len(prompt) - 1
    for a, b in zip(pressed["prompt"], free["prompt"]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.rank == b.rank
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert pressed["tokens"] == free["tokens"]
