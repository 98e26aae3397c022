"""The cross-tenant timing oracle, re-run as a statistical test against the real gateway.

The probe: a conversation's next turn, too long for the context, so that the gateway answers 400 right
after tokenizing it. Its prefix is tokenized again unless the tokenizer cache holds it. A tenant who
sent the conversation's start makes its own probe faster (the positive control: the test can see the
cache); another tenant's probe must take as long whether that start was sent or not (the oracle closed).
"""

from __future__ import annotations

import math
import random
import statistics
import time

import httpx
from gw_harness import API_KEYS

PAIRS = 24
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def conversation(rng: random.Random) -> list[dict]:
    """A start of ~45k characters (~10k tokens: more than the tiny engine's 1024-token context)."""
    text = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(5000))
    return [{"role": "system", "content": f"session {rng.random()}"}, {"role": "user", "content": text}]


def next_turn(start: list[dict]) -> list[dict]:
    return [*start, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]


def timed_chat(client: httpx.Client, key: str, messages: list[dict]) -> float:
    start = time.perf_counter()
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                       headers={"Authorization": f"Bearer {key}"})
    elapsed = time.perf_counter() - start
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text
    return elapsed


def rank_sum_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation, no ties in timings)."""
    ranked = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    rank_a = sum(i + 1 for i, (_, group) in enumerate(ranked) if group == 0)
    n1, n2 = len(a), len(b)
    u = rank_a - n1 * (n1 + 1) / 2
    z = (u - n1 * n2 / 2) / math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return math.erfc(abs(z) / math.sqrt(2))


def probe_times(gateway, prober: str, rng: random.Random) -> tuple[list[float], list[float]]:
    """(probe times after the victim sent the start, probe times for starts nobody sent), interleaved."""
    seen, unseen = [], []
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        timed_chat(client, prober, next_turn(conversation(rng)))  # warm the connection and the code paths
        for _ in range(PAIRS):
            sent, fresh = conversation(rng), conversation(rng)
            timed_chat(client, API_KEYS[0], sent)  # the victim: tokenized, then refused; its start is cached
            order = [(True, sent), (False, fresh)]
            rng.shuffle(order)
            for was_sent, start in order:
                (seen if was_sent else unseen).append(timed_chat(client, prober, next_turn(start)))
    return seen, unseen


def report(who: str, seen: list[float], unseen: list[float]) -> float:
    p = rank_sum_p(seen, unseen)
    print(f"{who}: median probe {statistics.median(seen) * 1e3:.2f} ms after the start was sent, "
          f"{statistics.median(unseen) * 1e3:.2f} ms for an unsent one; rank-sum p = {p:.3g}")
    return p


def test_the_victims_own_cache_shows(gateway):
    seen, unseen = probe_times(gateway, API_KEYS[0], random.Random(1))
    assert report("same tenant", seen, unseen) < 0.01 and sorted(seen)[PAIRS // 2] < sorted(unseen)[PAIRS // 2]


def test_another_tenant_cannot_tell_what_was_sent(gateway):
    seen, unseen = probe_times(gateway, API_KEYS[1], random.Random(2))
    assert report("other tenant", seen, unseen) > 0.01
