"""Speculative decoding (n-gram prompt lookup): the proposer against a brute-force search, the
verifier against the sampler row by row, and whole engines with and without speculation: greedy
outputs identical token for token (tiny model and the real SmolLM2), the KV pool exact after every
step, and a chi-square test that sampling keeps its distribution."""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections import Counter

import pytest
import torch
from starlette.testclient import TestClient
from test_structured import post, structured, synthetic_tokenizer_info, tiny_text

from engine.config import DUMMY_CONFIGS, EngineConfig
from engine.core import EngineCore
from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.kv_cache import KVCacheManager
from engine.models.llama import LlamaForCausalLM
from engine.protocol import EngineStats, GenerateRequest, SamplingParams
from engine.request import Sequence
from engine.sampler import Sampler
from engine.scheduler import SampledToken, Scheduler
from engine.server import build_app
from engine.spec_decode import NgramIndex, NgramProposer, verify
from kernels import load_ops

EOS = 2


# --- the proposer -------------------------------------------------------------------------------


def reference_draft(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The follower of the most recent earlier occurrence of the longest suffix, by a full scan;
    an occurrence that overlaps the suffix repeats with its period."""
    end = len(tokens)
    for n in range(min(ngram_max, end), ngram_min - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                pos = start + n
                return [tokens[pos + i] if pos + i < end else tokens[pos + (i % (end - pos))] for i in range(k)]
    return []


def test_ngram_index_proposes_what_a_full_scan_finds_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(20):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        index = NgramIndex(ngram_min=1 + trial % 2, ngram_max=3 + trial % 3, draft_len=4)
        while len(tokens) < 120:
            k = rng.randrange(1, 7)
            assert index.propose(tokens, k) == reference_draft(tokens, k, index.ngram_min, index.ngram_max), tokens
            tokens.extend(rng.randrange(5) for _ in range(rng.randrange(1, 4)))  # a step commits 1 + accepted


def test_ngram_index_prefers_the_longest_suffix_and_the_latest_occurrence():
    index = NgramIndex(ngram_min=1, ngram_max=3, draft_len=4)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 8, 9, 1, 2, 8, 9, 3, 4, 5, 7, 8, 9]
    assert index.propose(tokens, 3) == [1, 2, 8]  # "7 8 9" (3-gram) beats the later "8 9" (2-gram)
    tokens.append(6)
    assert index.propose(tokens, 2) == []  # 6 never occurred before
    tokens.extend([4, 5])
    assert index.propose(tokens, 2) == [7, 8]  # "4 5" at 8-9
    periodic = [1, 2, 3, 1, 2, 3, 1]
    assert NgramIndex(1, 2, 4).propose(periodic, 5) == [2, 3, 1, 2, 3]  # overlaps the suffix: repeats


def test_draft_length_doubles_after_full_acceptance_and_falls_after_a_rejection():
    proposer = NgramProposer(num_speculative_tokens=8, ngram_min=1, ngram_max=2)
    seq = Sequence("r", 0, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=100), None, [], None)
    assert proposer.propose(seq, max_len=3) == [3, 1, 2]  # capped by the caller
    lengths = []
    for accepted in (8, 2, 3, 6):
        proposer.record(seq, seq.ngram.draft_len, min(accepted, seq.ngram.draft_len))
        lengths.append(seq.ngram.draft_len)
    assert lengths == [8, 3, 6, 8]  # 8 of 8 (capped); 2 of 8 -> 3; 3 of 3 -> 6; 6 of 6 -> 8 (capped)
    stats = proposer.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 8 + 8 + 3 + 6, 8 + 2 + 3 + 6)
    assert stats.accepted_per_pos == [4, 4, 3, 2, 2, 2, 1, 1]


# --- the verifier -------------------------------------------------------------------------------


def draft_seq(output: list[int], drafts: list[int], **sampling) -> Sequence:
    seq = Sequence("r", 0, [5, 6], SamplingParams(**sampling), None, [], None)
    for t in output:
        seq.append_token(t)
    seq.draft_ids = list(drafts)
    return seq


def reference_rows(logits: torch.Tensor, seq: Sequence) -> list[int]:
    """Row j's greedy token as the sampler picks it had the first j drafts been generated."""
    tokens = []
    for j in range(len(seq.draft_ids) + 1):
        view = Sequence("v", 0, seq.prompt_ids, seq.sampling, None, [], None)
        for t in [*seq.output_ids, *seq.draft_ids[:j]]:
            view.append_token(t)
        tokens.append(Sampler((EOS,))(logits[j : j + 1].clone(), [view]).token_ids[0])
    return tokens


@pytest.mark.parametrize("sampling", [
    {},
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"repetition_penalty": 1.8},
    {"logit_bias": {3: 2.5, 4: -1.0}},
    {"min_tokens": 4},
])
def test_greedy_verification_commits_each_rows_sampler_token_up_to_the_first_miss(sampling):
    gen = torch.Generator().manual_seed(1)
    vocab = 12
    for trial in range(40):
        drafts = torch.randint(vocab, (4,), generator=gen).tolist()
        seq = draft_seq([3, 4], drafts, temperature=0.0, **sampling)
        logits = torch.randn(5, vocab, generator=gen) * 2
        # Make the draft the raw argmax of some leading rows, so that runs of acceptance happen.
        for j in range(int(torch.randint(5, (1,), generator=gen))):
            if j < 4:
                logits[j, drafts[j]] += 4.0
        expected = reference_rows(logits, seq)
        accepted = 0
        while accepted < 4 and expected[accepted] == drafts[accepted]:
            accepted += 1
        got = [t.token_id for t in verify(Sampler((EOS,)), logits.clone(), [seq])[0]]
        assert got == [*drafts[:accepted], expected[accepted]], (trial, sampling)


def test_verification_logprobs_are_those_of_each_committed_rows_raw_logits():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 10, generator=gen)
    drafts = [4, 7, 4]
    logits[[0, 1, 2], drafts] += 5.0  # argmaxes by a margin the penalty keeps: all accepted, a bonus from row 3
    seq = draft_seq([1], drafts, temperature=0.0, logprobs=2, presence_penalty=0.3)
    plain = draft_seq([1], [], temperature=0.0, logprobs=2)
    out = verify(Sampler((EOS,)), torch.cat([logits, logits[:1]]), [seq, plain])
    raw = logits.log_softmax(-1)
    assert [t.token_id for t in out[0]][:3] == drafts and len(out[0]) == 4
    for j, t in enumerate(out[0]):
        assert t.logprob.logprob == pytest.approx(raw[j, t.token_id].item())
        assert [tok for tok, _ in t.logprob.top] == raw[j].topk(2).indices.tolist()
    assert out[1][0].token_id == logits[0].argmax().item()  # a row without a draft: the plain sampler


# --- the scheduler and the KV pool ---------------------------------------------------------------


def test_a_stop_or_max_tokens_inside_a_committed_run_ends_the_sequence_there_and_the_rest_is_dropped():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    proposer = NgramProposer(4, 1, 2)
    scheduler = Scheduler(kv, 4, 64, eos_token_ids=(EOS,), proposer=proposer)
    prompt = [10, 11, 12, 13, 10, 11]
    stop = Sequence("stop", 0, prompt, SamplingParams(max_tokens=50, stop_token_ids=[13]), None, [], None)
    length = Sequence("length", 0, prompt, SamplingParams(max_tokens=3), None, [], None)
    for seq in (stop, length):
        scheduler.add_request([seq])
    step = scheduler.schedule().scheduled
    scheduler.update(step, [SampledToken(seq, 12, None) for seq, _ in step])  # prefill: "... 10 11" + 12
    step = scheduler.schedule().scheduled
    assert [(s.request_id, n, s.draft_ids) for s, n in step] == [("stop", 5, [13, 10, 11, 12]), ("length", 2, [13])]
    # Both drafts fully accepted, plus a bonus token: a stop token and max_tokens fall inside.
    sampled = [SampledToken(stop, t, None) for t in [13, 10, 11, 12, 40]]
    sampled += [SampledToken(length, t, None) for t in [13, 41]]
    outputs = scheduler.update(step, sampled)
    assert outputs == [stop, length]
    assert (stop.output_ids, stop.finish_reason) == ([12, 13], "stop")
    assert (length.output_ids, length.finish_reason) == ([12, 13, 41], "length")
    assert kv.check_integrity([]).used == 0
    assert proposer.stats.num_accepted_tokens == 5 and proposer.stats.accepted_per_pos == [2, 1, 1, 1]


def test_rejected_positions_roll_back_and_only_committed_blocks_are_hashed():
    kv = KVCacheManager(num_blocks=16, block_size=4, record_events=True)
    scheduler = Scheduler(kv, 4, 64, proposer=NgramProposer(8, 1, 2))
    seq = Sequence("r", 0, [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=50), None, [], None)
    scheduler.add_request([seq])
    step = scheduler.schedule().scheduled
    scheduler.update(step, [SampledToken(seq, 3, None)])
    step = scheduler.schedule().scheduled
    assert seq.draft_ids == [4, 5, 1, 2, 3, 4, 5, 1] and len(seq.block_ids) == 4  # 16 positions
    scheduler.update(step, [SampledToken(seq, 4, None), SampledToken(seq, 9, None)])  # 1 accepted, then 9
    assert seq.all_token_ids == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9] and seq.num_computed_tokens == 9
    assert len(seq.block_ids) == 3 and kv.free_queue and next(iter(kv.free_queue)) == 3  # reused first
    stored = [h for e in kv.drain_events() for h in getattr(e, "block_hashes", [])]
    assert stored == seq.block_hashes[:2]  # tokens 0-7: the two full committed blocks, nothing drafted
    kv.check_integrity([seq])


# --- whole engines ------------------------------------------------------------------------------


def tiny_engine(tiny, spec: bool, info=None, **overrides) -> EngineCore:
    model, config = tiny
    settings = {"num_kv_blocks": 128, "max_num_batched_tokens": 64, "max_num_seqs": 16, "block_size": 8,
                **({"speculative": "ngram", "num_speculative_tokens": 4, "ngram_min": 1} if spec else {}),
                **overrides}
    return EngineCore.from_model(EngineConfig(model="tiny", **settings), model, config, info)


def run(core: EngineCore, requests: list[GenerateRequest], on_step=None) -> dict:
    """(request id, index) -> (tokens, finish reason, logprobs), checking the pool after every step."""
    for r in requests:
        core.add_request(r)
    out: dict = {}
    while core.has_work():
        for f in core.step():
            tokens, _, lps = out.get((f.request_id, f.index), ([], None, []))
            out[f.request_id, f.index] = (tokens + f.token_ids, f.finish_reason, lps + (f.logprobs or []))
        core.check_integrity()
        if on_step is not None:
            on_step(core)
    assert core.check_integrity().used == 0
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][:2] == b[key][:2], key
        assert [lp.top[0][0] for lp in a[key][2]] == [lp.top[0][0] for lp in b[key][2]], key
        assert [lp.logprob for lp in a[key][2]] == pytest.approx([lp.logprob for lp in b[key][2]], abs=1e-4), key


def tiny_requests() -> list[GenerateRequest]:
    """24 greedy requests over periodic prompts (drafts get proposed; logit_bias on the period's
    tokens makes the peaky tiny model loop, so drafts get accepted) with every per-row feature."""
    rng = random.Random(0)
    features = [
        {}, {"logit_bias": None}, {"logit_bias": None, "frequency_penalty": 0.4},
        {"logit_bias": None, "presence_penalty": 1.0}, {"logit_bias": None, "repetition_penalty": 1.3},
        {"logit_bias": None, "stop_token_ids": None}, {"logit_bias": None, "min_tokens": 20, "stop_token_ids": None},
        {"logit_bias": None, "max_tokens": 7}, {"logit_bias": None, "logprobs": 3}, {"n": 2, "logit_bias": None},
        {"ignore_eos": False, "logit_bias": None}, {"logit_bias": None, "max_tokens": 1},
    ]
    requests = []
    for i in range(24):
        period = [rng.randrange(3, 400) for _ in range(rng.randrange(2, 6))]
        sampling = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True, **features[i % len(features)]}
        if "logit_bias" in sampling:
            sampling["logit_bias"] = {t: 6.0 for t in period}
        if "stop_token_ids" in sampling:
            sampling["stop_token_ids"] = [period[-1]]
        prompt = period * rng.randrange(2, 5) + period[: rng.randrange(len(period))]
        requests.append(GenerateRequest(f"t{i}", prompt, SamplingParams(**sampling)))
    return requests


def test_greedy_outputs_are_identical_with_and_without_speculation_on_the_tiny_model(tiny, monkeypatch):
    requests = tiny_requests()
    plain = run(tiny_engine(tiny, spec=False), requests)
    mixes = []
    import engine.model_runner as model_runner

    def spying_verify(sampler, logits, seqs):
        mixes.append((sum(bool(s.draft_ids) for s in seqs), sum(not s.draft_ids for s in seqs)))
        return verify(sampler, logits, seqs)

    monkeypatch.setattr(model_runner, "verify", spying_verify)
    core = tiny_engine(tiny, spec=True)
    spec = run(core, requests)
    assert_same(spec, plain)
    stats = core.stats()
    assert stats.spec_num_accepted_tokens > 100 and stats.spec_num_accepted_tokens_per_pos[3] > 10
    assert any(with_draft and without for with_draft, without in mixes)  # speculating and plain rows together
    stops = [spec[r.request_id, 0] for r in requests if r.sampling.stop_token_ids]
    assert any(finish == "stop" and len(tokens) < 40 for tokens, finish, _ in stops)


def test_the_padded_graph_buffers_verify_as_the_eager_path_does(tiny, monkeypatch):
    """The decode and verification graphs' static, padded inputs, run eagerly (no capture on the
    CPU): rows of 1 + K queries, drafts shorter than K padded, plain decodes among them."""
    requests = tiny_requests()
    plain = run(tiny_engine(tiny, spec=False), requests)
    core = tiny_engine(tiny, spec=True)
    runner = core.runner
    graphs = [DecodeGraphs(runner.model, runner.kv_caches, runner.device, runner.block_size, runner.max_blocks_per_seq,
                           decode_buckets(16), capture=False, query_len=q) for q in (1, 5)]
    runner.decode_graphs, runner.verify_graphs = graphs
    verify_runs = []
    run_verify = graphs[1].run
    monkeypatch.setattr(graphs[1], "run", lambda seqs: verify_runs.append(len(seqs)) or run_verify(seqs))
    assert_same(run(core, requests), plain)
    assert len(verify_runs) > 20 and max(verify_runs) > 1


def test_preemption_and_abort_with_speculation_keep_outputs_and_the_pool_exact(tiny):
    requests = tiny_requests()[:12]
    plain = run(tiny_engine(tiny, spec=False), requests)
    core = tiny_engine(tiny, spec=True, num_kv_blocks=24)  # 192 tokens for ~700 of demand
    assert_same(run(core, requests), plain)
    assert core.scheduler.num_preemptions > 0 and core.stats().spec_num_accepted_tokens > 0

    core = tiny_engine(tiny, spec=True)
    for r in requests:
        core.add_request(r)
    for _ in range(4):
        core.step()
    drafting = [s for s in core.live_sequences() if s.ngram is not None]
    assert drafting
    for s in drafting:
        core.abort(s.request_id)
    while core.has_work():
        core.step()
        core.check_integrity()
    assert core.check_integrity().used == 0


def test_grammar_masks_every_verification_row_and_the_matcher_rolls_back(tiny):
    info = synthetic_tokenizer_info(tiny[1].vocab_size, tiny[1].eos_token_ids[0])
    pattern = r"(ab|cd)( (ab|cd)){3,12}"
    vocab = info.decoded_vocab
    prompt_ids = [vocab.index(t) for t in (b"ab", b" ", b"cd", b" ")] * 4  # drafts the grammar admits
    clashing = [vocab.index(t) for t in (b"xy", b"ab", b" ", b"zz")] * 4  # drafts it refuses after "ab"
    requests = [GenerateRequest(f"g{i}", p, structured("regex", pattern, temperature=0.0, max_tokens=40))
                for i, p in enumerate((prompt_ids, clashing, prompt_ids[1:]))]
    plain = run(tiny_engine(tiny, spec=False, info=info), requests)
    core = tiny_engine(tiny, spec=True, info=info)
    spec = run(core, requests)
    assert_same(spec, plain)
    assert core.stats().spec_num_draft_tokens > 0
    for tokens, finish, _ in spec.values():
        assert finish == "stop" and re.fullmatch(pattern, tiny_text(tokens[:-1], info))


def test_seeded_sampling_with_speculation_is_reproducible_whatever_the_batch(tiny):
    requests = tiny_requests()[:8]
    seeded = [GenerateRequest(r.request_id, r.prompt_ids,
                              dataclasses.replace(r.sampling, temperature=1.0, seed=5))
              for r in requests]
    alone = run(tiny_engine(tiny, spec=True), seeded[:1])
    batched = run(tiny_engine(tiny, spec=True), seeded)
    assert alone[seeded[0].request_id, 0][:2] == batched[seeded[0].request_id, 0][:2]
    assert run(tiny_engine(tiny, spec=True), seeded) == batched


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; categories with fewer than 10 expected counts
    pooled into one."""
    total_a, total_b = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cells if (a[c] + b[c]) * min(total_a, total_b) / (total_a + total_b) >= 10]
    rows = [(a[c], b[c]) for c in big]
    rest = (total_a - sum(r[0] for r in rows), total_b - sum(r[1] for r in rows))
    if sum(rest):
        rows.append(rest)
    stat = 0.0
    n = total_a + total_b
    for x, y in rows:
        for observed, total in ((x, total_a), (y, total_b)):
            expected = (x + y) * total / n
            stat += (observed - expected) ** 2 / expected
    df = len(rows) - 1
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return torch.special.gammaincc(half[0], half[1]).item()  # the chi-square survival function


def test_sampled_outputs_keep_their_distribution_with_speculation():
    """The three generated tokens (the second from a verification row: an accepted draft or a
    residual draw; the third a bonus token or the next step's) of 12,000 seeded samples per arm, on
    the tiny shape with a 64-token vocabulary so that the joint outcomes are few."""
    torch.manual_seed(0)
    config = dataclasses.replace(DUMMY_CONFIGS["tiny"], vocab_size=64)
    model = LlamaForCausalLM(config, load_ops("torch"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    period = [17, 30, 45]
    bias = {17: 3.0, 30: 3.0, 45: 3.0}  # the drafts are likely, never certain
    sampling = {"max_tokens": 3, "temperature": 1.0, "top_k": 4, "logit_bias": bias, "ignore_eos": True, "n": 100}
    requests = [GenerateRequest(f"s{i}", period * 3, SamplingParams(**sampling, seed=1000 * i)) for i in range(120)]

    def sample(spec: bool) -> tuple[Counter, EngineStats]:
        core = tiny_engine((model, config), spec, max_num_seqs=256, max_num_batched_tokens=1024, num_kv_blocks=1024)
        out = run(core, requests)
        assert len(out) == 12_000
        return Counter(tuple(tokens) for tokens, _, _ in out.values()), core.stats()

    (plain, _), (spec, stats) = sample(False), sample(True)
    assert 0.2 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.8  # both ways taken often
    p = chi_square_p_value(plain, spec)
    assert p > 0.001, (p, plain.most_common(8), spec.most_common(8))
    # Power: the same test tells 12,000 draws from the plain distribution with 2 % of its mass moved
    # from its commonest outcome to its second from another 12,000 such draws, nearly always.
    cells = [c for c, _ in plain.most_common()]
    probs = torch.tensor([plain[c] for c in cells], dtype=torch.float64) / 12_000
    shifted = probs.clone()
    shifted[0] -= 0.02
    shifted[1] += 0.02
    gen = torch.Generator().manual_seed(0)
    detected = 0
    for _ in range(50):
        x = Counter(torch.multinomial(probs, 12_000, replacement=True, generator=gen).tolist())
        y = Counter(torch.multinomial(shifted, 12_000, replacement=True, generator=gen).tolist())
        detected += chi_square_p_value(x, y) < 0.001
    assert detected >= 45


def test_stats_carry_the_counters_over_the_wire(tiny):
    core = tiny_engine(tiny, spec=True)
    run(core, tiny_requests()[:6])
    stats = core.stats()
    assert len(stats.spec_num_accepted_tokens_per_pos) == 4
    assert stats.spec_num_accepted_tokens == sum(stats.spec_num_accepted_tokens_per_pos) > 0
    assert 0 < stats.spec_num_drafts <= stats.spec_num_draft_tokens
    assert EngineStats.from_wire(stats.to_wire()) == stats
    plain = tiny_engine(tiny, spec=False).stats()
    assert (plain.spec_num_drafts, plain.spec_num_accepted_tokens_per_pos) == (0, [])


def test_the_sidecar_exports_the_counters_under_vllm_names(tiny):
    config = EngineConfig(model="tiny", speculative="ngram")
    app = build_app(config, make_core=lambda: tiny_engine(tiny, spec=True), engine_process=False)
    with TestClient(app) as client:
        deadline = time.monotonic() + 60
        while (health := client.get("/health")).status_code != 200:  # the engine thread warms up
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        for request in tiny_requests()[:4]:
            assert post(client, request).status_code == 200
        while (stats := EngineStats.from_wire(client.get("/stats").json())).num_running:
            time.sleep(0.05)
        text = client.get("/metrics").text
    assert stats.spec_num_accepted_tokens > 0
    label = 'model_name="tiny"'
    assert f"vllm:spec_decode_num_drafts_total{{{label}}} {float(stats.spec_num_drafts)}" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{label}}} {float(stats.spec_num_draft_tokens)}" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{label}}} {float(stats.spec_num_accepted_tokens)}" in text
    for position, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
        assert f'per_pos_total{{{label},position="{position}"}} {float(count)}' in text


# --- the real SmolLM2 ---------------------------------------------------------------------------


CODE = '''def bubble_sort(items):
    n = len(items)
    for i in range(n):
        for j in range(0, n - i - 1):
            if items[j] > items[j + 1]:
                items[j], items[j + 1] = items[j + 1], items[j]
    return items
'''


@pytest.mark.slow
def test_greedy_outputs_are_identical_with_and_without_speculation_on_smollm2(smollm2, smollm2_tokenizer_info):
    model, config = smollm2
    by_bytes = {v: t for t, v in enumerate(smollm2_tokenizer_info.decoded_vocab) if v}

    def encode(text: str) -> list[int]:  # longest match over the vocabulary: not BPE's split, the same text
        data = text.encode()
        ids, i = [], 0
        while i < len(data):
            for j in range(min(len(data), i + 16), i, -1):
                if data[i:j] in by_bytes:
                    ids.append(by_bytes[data[i:j]])
                    i = j
                    break
            else:
                raise AssertionError(data[i:])
        return ids

    prompt = encode(f"Copy this code exactly:\n{CODE}\nCopy:\n")

    def engine(spec: bool) -> EngineCore:
        settings = {"speculative": "ngram", "num_speculative_tokens": 6} if spec else {}
        return EngineCore.from_model(EngineConfig(model="smollm2", num_kv_blocks=256, **settings), model, config)

    first = GenerateRequest("plain", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    copied = run(engine(False), [first])["plain", 0][0]
    stop = next(t for i, t in enumerate(copied) if i >= 20 and t not in copied[:i])  # first seen at i >= 20
    requests = [
        first,
        GenerateRequest("logprobs", prompt, SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)),
        GenerateRequest("stop", prompt, SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[stop])),
        GenerateRequest("length", prompt, SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)),
        GenerateRequest("penalty", prompt, SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.3)),
        GenerateRequest("short", encode("The capital of France is"), SamplingParams(max_tokens=20, temperature=0.0)),
    ]

    plain = run(engine(False), requests)
    core = engine(True)
    spec = run(core, requests)
    assert_same(spec, plain)
    stats = core.stats()
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.5, stats
    assert spec["stop", 0][1] == "stop" and spec["length", 0][1] == "length"
