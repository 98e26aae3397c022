"""The sampler against a plain per-row reference: penalties, filters, masking, logprobs, seeds."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from engine.protocol import SamplingParams
from engine.sampler import Sampler
from kernels import reference

EOS = (0, 2)
VOCAB = 512


@dataclass
class Seq:
    sampling: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: None = None


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0):
    return torch.randn(num_rows, vocab, generator=seeded(seed)) * scale


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the reference: one row at a time, in float64 Python ----


def softmax(x: list[float]) -> list[float]:
    top = max(x)
    exps = [math.exp(v - top) for v in x]
    total = sum(exps)
    return [e / total for e in exps]


def reference_logits(row: torch.Tensor, seq: Seq) -> list[float]:
    """logit_bias, min_tokens masking, then repetition, frequency and presence penalties."""
    p = seq.sampling
    x = [float(v) for v in row]
    for token_id, bias in p.logit_bias.items():
        x[token_id] += bias
    if len(seq.output_ids) < p.min_tokens:
        for token_id in [*p.stop_token_ids, *([] if p.ignore_eos else EOS)]:
            x[token_id] = -math.inf
    for token_id in set(seq.prompt_ids) | set(seq.output_ids):
        if x[token_id] > 0:
            x[token_id] /= p.repetition_penalty
        else:
            x[token_id] *= p.repetition_penalty
    for token_id, count in Counter(seq.output_ids).items():
        x[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return x


def reference_probs(row: torch.Tensor, seq: Seq) -> list[float]:
    p = seq.sampling
    x = reference_logits(row, seq)
    if p.temperature == 0.0:
        best = x.index(max(x))  # first maximum: lowest id on ties
        return [1.0 if t == best else 0.0 for t in range(len(x))]
    x = [v / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if p.top_p < 1.0:
        probs = softmax(x)
        kept, mass = set(), 0.0
        for token_id in sorted(range(len(x)), key=lambda t: -probs[t]):
            kept.add(token_id)
            if mass + probs[token_id] >= p.top_p:
                # The test data must not sit on the cut-off, where float32 and float64 may differ.
                assert mass == 0.0 or mass < p.top_p - 1e-5  # the likeliest token always stays
                assert mass + probs[token_id] > p.top_p + 1e-5
                break
            mass += probs[token_id]
        x = [v if t in kept else -math.inf for t, v in enumerate(x)]
    probs = softmax(x)
    if p.min_p > 0.0:
        threshold = p.min_p * max(probs)
        assert all(abs(q - threshold) > 1e-6 * threshold for q in probs)
        probs = [q if q >= threshold else 0.0 for q in probs]
        total = sum(probs)
        probs = [q / total for q in probs]
    return probs


def assert_matches_reference(sampler: Sampler, logits: torch.Tensor, seqs: list[Seq]) -> None:
    """Same support (tokens with non-zero probability) and the same probabilities, row by row."""
    got = sampler.probs(logits.clone(), seqs)
    for i, seq in enumerate(seqs):
        want = torch.tensor(reference_probs(logits[i], seq), dtype=torch.float64)
        # Below 1e-30 float32 may underflow (a -100 logit bias) where float64 does not.
        assert torch.equal(got[i] > 1e-30, want > 1e-30), f"row {i}: support differs"
        torch.testing.assert_close(got[i].double(), want, rtol=1e-4, atol=1e-7, msg=f"row {i}")


# ---- greedy ----


def test_greedy_is_argmax_of_processed_logits():
    sampler = Sampler(EOS)
    logits = random_logits(5)
    seqs = [
        Seq(SamplingParams(temperature=0.0)),
        Seq(SamplingParams(temperature=0.0, repetition_penalty=1.5), [1, 2], [3]),
        Seq(SamplingParams(temperature=0.0, frequency_penalty=1.0), [], [7, 7, 8]),
        Seq(SamplingParams(temperature=0.0, logit_bias={11: 40.0})),
        Seq(SamplingParams(temperature=0.0, top_k=3, top_p=0.5)),  # filters do not change greedy
    ]
    got = sampler(logits.clone(), seqs).token_ids
    want = [reference_probs(logits[i], s).index(1.0) for i, s in enumerate(seqs)]
    assert got == want
    assert got[3] == 11
    # The penalized rows pick something other than the raw argmax, so the penalties are in play.
    raw = logits.argmax(-1).tolist()
    seqs[1].prompt_ids, seqs[2].output_ids = [raw[1]], [raw[2]] * 3
    got = sampler(logits.clone(), seqs).token_ids
    assert got[1] != raw[1] and got[2] != raw[2]
    assert got == [reference_probs(logits[i], s).index(1.0) for i, s in enumerate(seqs)]


@pytest.mark.parametrize(
    "params,output_ids,plain",
    [
        (SamplingParams(temperature=0.0), [], True),
        (SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=1), [], True),  # no effect on greedy
        (SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), [], True),  # nothing to mask
        (SamplingParams(temperature=0.0, min_tokens=2), [5, 6], True),  # reached
        (SamplingParams(temperature=0.0, min_tokens=2), [5], False),  # EOS masked
        (SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[9]), [], False),
        (SamplingParams(temperature=0.7), [], False),
        (SamplingParams(temperature=0.0, logprobs=0), [], False),
        (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [], False),
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), [], False),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), [], False),
        (SamplingParams(temperature=0.0, frequency_penalty=0.5), [], False),
    ],
)
def test_plain_greedy_rows_need_only_the_raw_argmax(params, output_ids, plain):
    """The rows for which a CUDA graph's argmax replaces the sampler; one row decides for the batch."""
    sampler = Sampler(EOS)
    seq = Seq(params, [1, 2], output_ids)
    assert sampler.plain_greedy([seq]) is plain
    assert sampler.plain_greedy([Seq(SamplingParams(temperature=0.0)), seq]) is plain
    if plain:
        logits = random_logits(4)
        assert sampler(logits.clone(), [seq] * 4).token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, VOCAB)
    logits[0, [9, 4, 300]] = 5.0
    logits[1, [7, 8]] = 1.0
    seqs = [Seq(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert Sampler(EOS)(logits, seqs).token_ids == [4, 7]


# ---- penalties and logit bias ----

PROMPT = [5, 6, 7, 7, 40, 41]
OUTPUT = [7, 9, 9, 9, 41, 100, 101, 101]


@pytest.mark.parametrize(
    "params",
    [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(frequency_penalty=0.8),
        dict(frequency_penalty=-1.5),
        dict(presence_penalty=1.2),
        dict(presence_penalty=-0.6),
        dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_penalty_matches_reference(params):
    sampler = Sampler(EOS)
    logits = random_logits(3, seed=1)
    # Make the penalized tokens matter: some strongly positive, some strongly negative.
    logits[:, [5, 7, 9, 41, 100]] = torch.tensor([6.0, 8.0, 7.0, -5.0, 5.0])
    seqs = [
        Seq(SamplingParams(**params), PROMPT, OUTPUT),
        Seq(SamplingParams(), PROMPT, OUTPUT),  # no penalty: untouched
        Seq(SamplingParams(**params), [1, 2, 3], []),  # nothing generated yet
    ]
    assert_matches_reference(sampler, logits, seqs)
    penalized = sampler.probs(logits[:1].clone(), seqs[:1])[0]
    assert not torch.allclose(penalized, logits[0].softmax(-1), atol=1e-3)


def test_penalty_semantics_by_hand():
    """Repetition covers prompt and output; frequency and presence count the output only."""
    logits = torch.zeros(4, VOCAB)
    logits[:, 5] = 4.0  # in the prompt only
    logits[:, 9] = 4.0  # in the output, 3 times
    logits[:, 12] = -2.0  # in the output once, negative
    seqs = [
        Seq(SamplingParams(repetition_penalty=2.0), [5], [9, 9, 9, 12]),
        Seq(SamplingParams(frequency_penalty=1.0), [5], [9, 9, 9, 12]),
        Seq(SamplingParams(presence_penalty=1.0), [5], [9, 9, 9, 12]),
        Seq(SamplingParams(repetition_penalty=0.5), [5], [9, 9, 9, 12]),
    ]
    probs = Sampler(EOS).probs(logits, seqs)
    # Logit of token t after processing, relative to an untouched token whose logit stays 0.
    processed = (probs[:, [5, 9, 12]] / probs[:, [1]]).log()
    want = torch.tensor([[2.0, 2.0, -4.0], [4.0, 1.0, -3.0], [4.0, 3.0, -3.0], [8.0, 8.0, -1.0]])
    torch.testing.assert_close(processed, want, rtol=0, atol=1e-5)


def test_logit_bias():
    sampler = Sampler(EOS)
    logits = random_logits(3, seed=2)
    seqs = [
        Seq(SamplingParams(logit_bias={3: 5.0, 17: -100.0, int(logits[0].argmax()): -2.5})),
        Seq(SamplingParams(temperature=0.0, logit_bias={99: 100.0})),
        Seq(SamplingParams(logit_bias={4: 1.0}, repetition_penalty=1.5), [4], []),
    ]
    assert_matches_reference(sampler, logits, seqs)
    assert sampler(logits.clone(), seqs).token_ids[1] == 99


# ---- min_tokens ----


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    sampler = Sampler(EOS)
    logits = random_logits(5, seed=3)
    logits[:, [0, 2, 5]] = 20.0  # EOS ids 0 and 2, stop id 5: the likeliest tokens by far
    seqs = [
        Seq(SamplingParams(min_tokens=3, stop_token_ids=[5]), [1], [8, 9]),  # 2 < 3: masked
        Seq(SamplingParams(min_tokens=3, stop_token_ids=[5]), [1], [8, 9, 10]),  # reached
        Seq(SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True), [1], []),
        Seq(SamplingParams(ignore_eos=True, stop_token_ids=[5])),  # ignore_eos alone masks nothing
        Seq(SamplingParams(temperature=0.0, min_tokens=1, repetition_penalty=1.3), [0], []),
    ]
    assert_matches_reference(sampler, logits, seqs)
    probs = sampler.probs(logits.clone(), seqs)
    assert probs[0, [0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert probs[1, [0, 2, 5]].min() > 0.3
    assert probs[2, [0, 2]].min() > 0.4 and probs[2, 5].item() == 0.0
    assert probs[3, [0, 2, 5]].min() > 0.3
    tokens = sampler(logits.clone(), seqs).token_ids
    assert tokens[0] not in (0, 2, 5) and tokens[4] not in (0, 2)


# ---- top-k, top-p, min-p ----

FILTERS = [
    dict(top_k=5),
    dict(top_k=1),
    dict(top_k=-1),
    dict(top_k=VOCAB + 10),
    dict(top_p=0.5),
    dict(top_p=1e-6),  # keeps the likeliest token only
    dict(top_p=0.9, top_k=20),
    dict(min_p=0.05),
    dict(min_p=0.5, temperature=0.5),
    dict(top_k=50, top_p=0.8, min_p=0.1, temperature=0.7),
    dict(temperature=1.7),
    dict(top_k=30, temperature=0.0),
]


@pytest.mark.parametrize("together", [True, False], ids=["one-batch", "row-by-row"])
def test_filters_match_reference(together):
    sampler = Sampler(EOS)
    logits = random_logits(len(FILTERS), seed=4)
    seqs = [Seq(SamplingParams(**f)) for f in FILTERS]
    if together:
        assert_matches_reference(sampler, logits, seqs)
    else:
        for i, seq in enumerate(seqs):
            assert_matches_reference(sampler, logits[i : i + 1], [seq])
    support = (sampler.probs(logits.clone(), seqs) > 0).sum(-1).tolist()
    assert support[:4] == [5, 1, VOCAB, VOCAB] and support[5] == 1 and support[10] == VOCAB
    assert all(n < VOCAB for n in support[4:10])


def test_top_k_alone_matches_reference():
    sampler = Sampler(EOS)
    logits = random_logits(4, seed=5)
    ks_and_temperatures = [(3, 1.0), (40, 0.5), (0, 1.0), (7, 2.0)]
    seqs = [Seq(SamplingParams(top_k=k, temperature=t)) for k, t in ks_and_temperatures]
    assert_matches_reference(sampler, logits, seqs)
    assert (sampler.probs(logits.clone(), seqs) > 0).sum(-1).tolist() == [3, 40, VOCAB, 7]


def test_top_p_mass_and_min_p_threshold():
    sampler = Sampler(EOS)
    logits = random_logits(2, seed=6, scale=2.0)
    seqs = [Seq(SamplingParams(top_p=0.7)), Seq(SamplingParams(min_p=0.2))]
    probs = sampler.probs(logits.clone(), seqs)
    full = logits.softmax(-1)
    kept = probs[0] > 0
    # The kept tokens are the likeliest ones, hold >= 0.7 of the mass, and none could be spared.
    assert full[0][kept].min() > full[0][~kept].max()
    assert full[0][kept].sum() >= 0.7 > full[0][kept].sum() - full[0][kept].min()
    assert torch.equal(probs[1] > 0, full[1] >= 0.2 * full[1].max())


# ---- logprobs ----


def test_logprobs_are_raw_and_best_first():
    sampler = Sampler(EOS)
    logits = random_logits(5, seed=7)
    seqs = [
        Seq(SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, top_k=10), [1]),
        Seq(SamplingParams(logprobs=0)),
        Seq(SamplingParams(logprobs=20, temperature=0.0, logit_bias={3: 50.0})),
        Seq(SamplingParams()),  # no logprobs asked
        Seq(SamplingParams(logprobs=1, min_tokens=2), [], []),
    ]
    out = sampler(logits.clone(), seqs)
    raw = logits.double().log_softmax(-1)
    assert out.logprobs[3] is None
    assert out.token_ids[2] == 3
    for i, k in [(0, 5), (1, 0), (2, 20), (4, 1)]:
        lp = out.logprobs[i]
        assert lp.logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-5)
        assert len(lp.top) == k
        want_ids = raw[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in lp.top] == want_ids
        for token_id, value in lp.top:
            assert value == pytest.approx(raw[i, token_id].item(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    # Raw: the sampled token 3 was forced by a bias, yet its logprob is that of the unbiased logits.
    assert out.logprobs[2].logprob < out.logprobs[2].top[0][1]


# ---- seeds and the draw ----


def test_seeded_rows_reproduce_across_batch_composition_and_position():
    vocab, steps = 4096, 6
    sampler = Sampler(EOS)
    step_logits = [random_logits(1, vocab, seed=100 + s, scale=2.0)[0] for s in range(steps)]
    a_params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, frequency_penalty=0.3)
    b_params = SamplingParams(temperature=1.2, min_p=0.01, seed=99)

    def run(layout: list[str]) -> dict[str, list[int]]:
        """Decode ``steps`` tokens for the rows named in layout; "a" and "b" are seeded."""
        seqs = {
            "a": Seq(a_params, [1, 2, 3], generator=seeded(1234)),
            "b": Seq(b_params, [4], generator=seeded(99)),
            "x": Seq(SamplingParams(temperature=1.0, top_k=50), [5]),
            "y": Seq(SamplingParams(temperature=0.0, presence_penalty=1.0), [6]),
            "z": Seq(SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.1), [7]),
            "w": Seq(SamplingParams(min_p=0.2, top_p=0.5, logit_bias={3: 4.0}), [8]),
        }
        for s in range(steps):
            rows = [seqs[name] for name in layout]
            logits = torch.stack(
                [step_logits[s] if name in "ab" else torch.randn(vocab) * 2 for name in layout]
            )
            for seq, token_id in zip(rows, sampler(logits, rows).token_ids):
                seq.output_ids.append(token_id)
        return {name: seqs[name].output_ids for name in layout}

    with torch.random.fork_rng(devices=[]):  # the unseeded rows draw from the default generator
        alone = run(["a"])["a"]
        b_alone = run(["b"])["b"]
        mixed = run(["x", "y", "a", "z", "b"])
        reordered = run(["b", "w", "z", "x", "y", "a"])
    assert mixed["a"] == reordered["a"] == alone
    assert mixed["b"] == reordered["b"] == b_alone
    assert len(set(alone)) > 1 and alone != b_alone  # the stream really is random


def test_greedy_rows_ignore_generators_and_unseeded_rows_vary():
    sampler = Sampler(EOS)
    logits = random_logits(2, seed=8)
    greedy = Seq(SamplingParams(temperature=0.0, seed=1), generator=seeded(1))
    assert sampler(logits[:1].clone(), [greedy]).token_ids == [int(logits[0].argmax())]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        seqs = [Seq(SamplingParams())] * 2
        draws = {tuple(sampler(logits.clone(), seqs).token_ids) for _ in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("seeded_rows,filtered", [(False, True), (True, True), (False, False)],
                         ids=["default-generator", "own-generators", "temperature-alone"])
def test_draw_frequencies_match_probabilities(seeded_rows, filtered):
    """Filtered rows draw after a softmax; unseeded rows at a temperature alone in sample_argmax."""
    vocab, num_draws = 12, 20_000
    sampler = Sampler(EOS)
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 1.2, -1.0, 0.8, 0.1, -2.0])
    params = SamplingParams(temperature=0.8, top_k=8, min_p=0.1) if filtered else SamplingParams(temperature=0.8)
    want = torch.tensor(reference_probs(row, Seq(params)), dtype=torch.float64)
    assert (want == 0).sum() >= 5 if filtered else (want > 0).all()  # filtered-out tokens are never drawn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if seeded_rows:
            # Many short seeded streams: 1000 rows with their own generators, 20 steps each.
            seqs = [Seq(params, generator=seeded(s)) for s in range(1000)]
            logits = row.expand(len(seqs), vocab)
            tokens = [t for _ in range(20) for t in sampler(logits.clone(), seqs).token_ids]
        else:
            logits = row.expand(num_draws, vocab).clone()
            tokens = sampler(logits, [Seq(params)] * num_draws).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / num_draws
    assert torch.equal(freq > 0, want > 0)
    # The binomial standard error at 20k draws is at most 0.0035; the seeds are fixed: no flakes.
    torch.testing.assert_close(freq, want, rtol=0, atol=0.015)


def test_greedy_and_unseeded_temperature_rows_take_one_kernel():
    """Greedy rows and unseeded ones at a temperature alone go to the op set's argmax/sample_argmax, in one
    call; seeded or filtered rows draw after a softmax; processors apply before either."""
    calls = []

    class Spy:
        def argmax(self, logits):
            calls.append(("argmax", logits.shape[0]))
            return reference.argmax(logits)

        def sample_argmax(self, logits, inv_temperature, seed):
            calls.append(("sample_argmax", inv_temperature.tolist()))
            return reference.sample_argmax(logits, inv_temperature, seed)

    sampler = Sampler(EOS, Spy())
    logits = random_logits(5, seed=9)
    seqs = [
        Seq(SamplingParams(temperature=0.0, logit_bias={33: 100.0})),
        Seq(SamplingParams(temperature=0.5, logit_bias={44: 100.0})),
        Seq(SamplingParams(temperature=0.5, seed=3), generator=seeded(3)),
        Seq(SamplingParams(temperature=2.0, top_p=0.9)),
        Seq(SamplingParams(temperature=0.25, frequency_penalty=1.0), [], [7]),
    ]
    tokens = sampler(logits.clone(), seqs).token_ids
    assert calls == [("sample_argmax", [0.0, 2.0, 4.0])]
    assert tokens[:2] == [33, 44]
    calls.clear()
    assert sampler(logits[:1].clone(), seqs[:1]).token_ids == [33]
    assert calls == [("argmax", 1)]
    calls.clear()
    sampler(logits[2:4].clone(), seqs[2:4])
    assert calls == []


@pytest.mark.parametrize(
    "seq,inv_temperature",
    [
        (Seq(SamplingParams(temperature=0.0, top_k=3, seed=1), generator=seeded(1)), [0.0]),  # greedy ignores both
        (Seq(SamplingParams(temperature=0.5)), [2.0]),
        (Seq(SamplingParams(temperature=0.5, seed=1), generator=seeded(1)), None),
        (Seq(SamplingParams(temperature=0.5, top_p=0.9)), None),
        (Seq(SamplingParams(temperature=0.5, logprobs=1)), None),
        (Seq(SamplingParams(temperature=0.5, logit_bias={3: 1.0})), None),
        (Seq(SamplingParams(temperature=0.5, presence_penalty=0.5)), None),
    ],
)
def test_direct_draw_is_what_sample_does(seq, inv_temperature):
    """Rows that are greedy or at a temperature alone, with nothing applied to their logits, get a
    DirectDraw (one row decides for the batch): sample_argmax with it picks the tokens the sampler
    does from the same state of torch's generator, from bf16 logits unwidened; other batches get None."""
    sampler = Sampler(EOS)
    seqs = [Seq(SamplingParams(temperature=0.0)), seq]
    torch.manual_seed(4)
    draw = sampler.direct_draw(seqs)
    if inv_temperature is None:
        assert draw is None
        return
    assert draw.inv_temperature == [0.0, *inv_temperature] and (draw.seed != 0) == any(inv_temperature)
    logits = random_logits(2).bfloat16()
    tokens = reference.sample_argmax(logits, torch.tensor(draw.inv_temperature), draw.seed)
    dtypes = []

    class Spy:
        def argmax(self, logits):
            dtypes.append(logits.dtype)
            return reference.argmax(logits)

        def sample_argmax(self, logits, inv_temperature, seed):
            dtypes.append(logits.dtype)
            return reference.sample_argmax(logits, inv_temperature, seed)

    torch.manual_seed(4)
    assert Sampler(EOS, Spy())(logits.clone(), seqs).token_ids == tokens.tolist() and dtypes == [torch.bfloat16]


def test_narrow_logits_are_widened_where_a_row_needs_more():
    """bf16 logits with a penalized row: the sampler works on their fp32 widening (the penalty's
    arithmetic as on fp32 logits), the direct rows' kernel too."""
    dtypes = []

    class Spy:
        def sample_argmax(self, logits, inv_temperature, seed):
            dtypes.append(logits.dtype)
            return reference.sample_argmax(logits, inv_temperature, seed)

    logits = random_logits(2).bfloat16()
    seqs = [Seq(SamplingParams(temperature=0.5)), Seq(SamplingParams(temperature=0.0, repetition_penalty=1.5), [9])]
    torch.manual_seed(1)
    want = Sampler(EOS)(logits.float(), seqs).token_ids
    torch.manual_seed(1)
    assert Sampler(EOS, Spy())(logits, seqs).token_ids == want and dtypes == [torch.float32]


def test_logits_must_match_the_batch():
    with pytest.raises(ValueError, match="do not match 2 sequences"):
        Sampler(EOS)(torch.zeros(3, VOCAB), [Seq(SamplingParams())] * 2)
