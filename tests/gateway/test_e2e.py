"""End to end with real processes: a tiny dummy engine and the gateway, driven by the openai SDK.

The dummy model's text is gibberish, but the token flow is real: greedy decoding is deterministic, so
a stop string or a seed can be checked against a first, unconstrained generation.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from gw_harness import API_KEYS, Proc, lines_for

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Say something."}]
NO_EOS = {"ignore_eos": True}  # a random model might sample EOS; these tests want exact lengths


def sync_client(gw: Proc, key: str = API_KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def async_client(gw: Proc, key: str = API_KEYS[0]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_engine_idle(engine: Proc, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(engine.url + "/stats").json()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if (idle and stats["num_free_blocks"] == stats["num_total_blocks"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def test_models(gateway):
    client = sync_client(gateway)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.root == MODEL and card.max_model_len == models.data[0].max_model_len
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


@pytest.mark.parametrize("k", [0, 1, 4])
def test_completion_logprobs_always_hold_the_sampled_token(gateway, k):
    choice = sync_client(gateway).completions.create(model=MODEL, prompt="Logprobs", max_tokens=50, temperature=1.5,
                                                      seed=k, logprobs=k, extra_body=NO_EOS).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 50
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and len(top) <= k + 1
        if k == 0:
            assert top == {token: logprob}


def test_chat_non_streamed(gateway):
    resp = sync_client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                        temperature=0, extra_body=NO_EOS)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    (choice,) = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    usage = resp.usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


async def test_chat_streamed_equals_non_streamed_async(gateway):
    client = async_client(gateway)
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5, extra_body=NO_EOS)
    full = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    await client.close()


def test_completions_streamed_and_not(gateway):
    client = sync_client(gateway)
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                     extra_body=NO_EOS)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 7 and full.usage.prompt_tokens == 4
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                            stream=True, extra_body=NO_EOS))
    assert "".join(p.choices[0].text for p in pieces) == full.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


async def test_completions_batch_of_prompts_and_token_ids_async(gateway):
    client = async_client(gateway)
    ids = (await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1, temperature=0,
                                           logprobs=0, extra_body=NO_EOS)).usage.prompt_tokens
    assert ids == 2
    resp = await client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], n=2,
                                           max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples of a prompt agree
    assert resp.usage.completion_tokens == 12
    single = await client.completions.create(model=MODEL, prompt=[[49, 50, 51], [52, 53]], max_tokens=2,
                                             temperature=0, stream=True, extra_body=NO_EOS)
    texts: dict[int, str] = {}
    async for chunk in single:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1]
    await client.close()


def test_n2_streamed_and_not(gateway):
    client = sync_client(gateway)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=5, temperature=1.0,
                                          seed=7, extra_body=NO_EOS)
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=5, temperature=1.0,
                                                seed=7, stream=True, extra_body=NO_EOS):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "length", 1: "length"}
    assert texts == {c.index: c.message.content for c in resp.choices}  # same seed, same samples


def test_seed_reproducibility(gateway):
    client = sync_client(gateway)

    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="The weather today", max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body=NO_EOS).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def boundary_stop(text: str, tokens: list[str], offsets: list[int]) -> tuple[str, int]:
    """A stop string spanning a token boundary whose first occurrence is there, and that token's index."""
    for k in range(1, len(tokens)):
        o = offsets[k]
        if len(tokens[k - 1]) >= 2 and len(tokens[k]) >= 2:
            stop = text[o - 2:o + 2]
            if text.index(stop) == o - 2:
                return stop, k
    raise AssertionError(f"no usable token boundary in {tokens!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens_cuts_and_aborts(gateway, dummy_engine, stream):
    client = sync_client(gateway)
    args = dict(model=MODEL, prompt="A stop string test", max_tokens=40, temperature=0, extra_body=NO_EOS)
    probe = client.completions.create(**args, logprobs=0).choices[0]
    text, tokens, offsets = probe.text, probe.logprobs.tokens, probe.logprobs.text_offset
    assert "".join(tokens) == text and offsets == sorted(offsets)
    stop, k = boundary_stop(text, tokens, offsets)
    if stream:
        chunks = list(client.completions.create(**args, stop=[stop, "never-appears"], stream=True,
                                                stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        resp = client.completions.create(**args, stop=[stop, "never-appears"])
        got, finish, usage = resp.choices[0].text, [resp.choices[0].finish_reason], resp.usage
    assert got == text[: text.index(stop)] and finish == ["stop"]
    assert usage.completion_tokens == k + 1  # the tokens up to the one completing the stop string
    stats = wait_engine_idle(dummy_engine)  # the engine request was aborted, its blocks are free
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    kept = client.completions.create(**{**args, "extra_body": {**NO_EOS, "include_stop_str_in_output": True}},
                                     stop=stop)
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_chat_logprobs(gateway):
    resp = sync_client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                        logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == 6
    assert b"".join(bytes(e.bytes) for e in content) == choice.message.content.encode()
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    only = sync_client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                                        logprobs=True, extra_body=NO_EOS)
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[], []]


async def test_streamed_logprobs_async(gateway):
    client = async_client(gateway)
    entries = []
    async for chunk in await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                            temperature=0, logprobs=True, top_logprobs=2,
                                                            stream=True, extra_body=NO_EOS):
        if chunk.choices and chunk.choices[0].logprobs:
            entries += chunk.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)
    resp = await client.completions.create(model=MODEL, prompt="Logprobs please", max_tokens=4, temperature=0,
                                           logprobs=2, extra_body=NO_EOS)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-4)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    await client.close()


SEEDED = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, extra_body=NO_EOS)


def stop_after_a_few_chars(client: openai.OpenAI) -> tuple[str, str]:
    """A stop string from a seeded answer, so that the same request ends with finish_reason "stop" (the
    SDK's stream helper refuses "length"); returns it and the text expected before it."""
    text = client.chat.completions.create(**SEEDED).choices[0].message.content
    start = next(i for i in range(3, len(text) - 2) if text.index(text[i:i + 2]) == i)
    return text[start:start + 2], text[:start]


def test_stream_helper_sync(gateway):
    client = sync_client(gateway)
    stop, expected = stop_after_a_few_chars(client)
    deltas = []
    with client.chat.completions.stream(**SEEDED, stop=stop) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "".join(deltas) == expected
    assert final.choices[0].finish_reason == "stop"


async def test_stream_helper_async(gateway):
    stop, expected = stop_after_a_few_chars(sync_client(gateway))
    client = async_client(gateway)
    async with client.chat.completions.stream(**SEEDED, stop=[stop],
                                              stream_options={"include_usage": True}) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert final.choices[0].message.content == expected and final.choices[0].finish_reason == "stop"
    assert 0 < final.usage.completion_tokens < 12
    await client.close()


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_on_a_repeated_long_prompt_per_tenant(gateway, stream):
    long_system = f"Shared instructions for run {stream}. " + "Follow the rules carefully. " * 40
    messages = [{"role": "system", "content": long_system}, {"role": "user", "content": "Go."}]

    def usage(key: str):
        client = sync_client(gateway, key)
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=NO_EOS).usage
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=NO_EOS))
        return chunks[-1].usage

    # Earlier requests of a tenant may have left "<|im_start|>system\n" cached: less than one 16-token block.
    cold = usage(API_KEYS[0])
    assert cold.prompt_tokens > 200 and cold.prompt_tokens_details.cached_tokens < 16
    warm = usage(API_KEYS[0])
    assert warm.prompt_tokens == cold.prompt_tokens
    assert warm.prompt_tokens_details.cached_tokens >= cold.prompt_tokens - 16  # all full blocks at least
    other_tenant = usage(API_KEYS[1])  # another key is another cache salt: the long prefix is not shared
    assert other_tenant.prompt_tokens_details.cached_tokens < 16


def test_request_id_echoed_and_logged_with_tenant_and_tokens(gateway):
    resp = httpx.post(gateway.url + "/v1/completions", headers={
        "Authorization": f"Bearer {API_KEYS[0]}", "X-Request-Id": "e2e-req-1", "X-Forwarded-For": "203.0.113.9",
    }, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "e2e-req-1"
    generated = httpx.get(gateway.url + "/health")
    assert len(generated.headers["x-request-id"]) == 32
    (line,) = [x for x in lines_for(gateway, "e2e-req-1") if x.get("event") == "request"]
    assert line["status"] == 200 and line["tenant"].startswith("key-") and line["prompt_tokens"] == 1
    assert line["completion_tokens"] == 2 and line["cached_tokens"] == 0 and line["replica"]
    assert line["client"] == "203.0.113.9"  # 127.0.0.1 is a trusted proxy for this gateway
    assert API_KEYS[0] not in gateway.log_path.read_text()  # keys never reach the logs


def test_sse_headers_and_boundaries_logged(gateway):
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers={
        "Authorization": f"Bearer {API_KEYS[0]}", "X-Request-Id": "e2e-sse-1",
    }, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}, timeout=30) as resp:
        body = resp.read().decode()
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-accel-buffering"] == "no" and resp.headers["cache-control"] == "no-cache"
    assert body.endswith("data: [DONE]\n\n")
    (debug,) = [x for x in lines_for(gateway, "e2e-sse-1") if x.get("event") == "cache_boundaries"]
    assert len(debug["boundaries"]) == 2 and debug["boundaries"][1] < debug["prompt_tokens"]


def test_openapi_generated_from_the_request_models(gateway):
    doc = httpx.get(gateway.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEYS[1]}"}).json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_completion_tokens", "top_logprobs", "min_p", "stop_token_ids"} <= set(chat["properties"])
    assert {"tools", "tool_choice", "response_format", "structured_outputs"} <= set(chat["properties"])
    assert "not supported" in chat["properties"]["functions"]["description"]
    assert "/v1/completions" in doc["paths"]


def test_metrics_count_requests_and_tokens(gateway):
    text = httpx.get(gateway.url + "/metrics").text
    assert 'kvgate_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "kvgate_gateway_completion_tokens_total" in text and "kvgate_gateway_replica_ready" in text


def test_multi_turn_resumes_at_the_probed_boundary(gateway):
    """Each turn's prompt is cached at least up to where the previous turn's last message ended: the
    boundary the gateway probed and sent along (the engine keeps the partial page there)."""
    client = sync_client(gateway, API_KEYS[1])
    messages = [{"role": "system", "content": "Multi-turn test assistant. " * 5},
                {"role": "user", "content": "First question?"}]
    previous_boundary = None
    for turn in range(3):
        request_id = f"multi-turn-{turn}"
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=1.0,
                                              seed=turn, extra_body=NO_EOS, extra_headers={"X-Request-Id": request_id})
        (probe,) = [x for x in lines_for(gateway, request_id) if x.get("event") == "cache_boundaries"]
        system_end, last_end = probe["boundaries"]
        assert 0 < system_end < last_end < resp.usage.prompt_tokens
        if previous_boundary is not None:
            assert resp.usage.prompt_tokens_details.cached_tokens >= previous_boundary
        previous_boundary = last_end
        messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                     {"role": "user", "content": f"Follow-up {turn}?"}]
