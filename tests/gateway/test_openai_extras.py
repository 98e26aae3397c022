"""The OpenAI/vLLM extras through the official openai SDK against real processes (tiny dummy engine):
echo and prompt logprobs, chat continuation, token ids and truncation, /tokenize and /detokenize,
continuous usage, stop_reason, per-request cache_salt, lenient messages, /version, and the vLLM metric
names on the engine's /metrics moving under load."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from gw_harness import API_KEYS, Proc
from prometheus_client.parser import text_string_to_metric_families
from test_e2e import MESSAGES, MODEL, NO_EOS, sync_client, wait_engine_idle

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def post(gw: Proc, path: str, **body) -> dict:
    resp = httpx.post(gw.url + path, json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_completions_echo_with_logprobs_holds_the_prompt(gateway):
    client = sync_client(gateway)
    prompt_ids = post(gateway, "/tokenize", prompt="Echo this prompt")["tokens"]
    for stream in (False, True):
        resp = client.completions.create(model=MODEL, prompt="Echo this prompt", echo=True, logprobs=2, max_tokens=4,
                                         temperature=0, extra_body={**NO_EOS, "return_token_ids": True},
                                         stream=stream)
        if stream:
            chunks = list(resp)
            text = "".join(c.choices[0].text for c in chunks)
            lp = {k: [v for c in chunks for v in getattr(c.choices[0].logprobs, k)] for k in
                  ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            token_ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            assert chunks[0].choices[0].model_extra["prompt_token_ids"] == prompt_ids
        else:
            choice = resp.choices[0]
            text, lp = choice.text, choice.logprobs.model_dump()
            token_ids = choice.model_extra["token_ids"]
            assert choice.model_extra["prompt_token_ids"] == prompt_ids
        assert text.startswith("Echo this prompt") and len(token_ids) == 4
        assert len(lp["tokens"]) == len(prompt_ids) + 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert "".join(lp["tokens"]) == text
    with_prompt_lps = client.completions.create(model=MODEL, prompt="Echo this prompt", max_tokens=1,
                                                extra_body={"prompt_logprobs": 2})
    prompt_lps = with_prompt_lps.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt_ids)
    for pos, entry in enumerate(prompt_lps[1:], 1):
        own = entry[str(prompt_ids[pos])]
        assert own["logprob"] == pytest.approx(lp["token_logprobs"][pos], abs=1e-6) and own["rank"] >= 1
        assert len(entry) <= 3


def test_prompt_logprobs_are_the_same_cold_and_on_a_prefix_hit(gateway, dummy_engine):
    client = sync_client(gateway)
    prompt = LONG_PROMPT + "prompt logprobs"
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    cached = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    hit = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert cached.usage.prompt_tokens_details.cached_tokens > 100  # the prompt is cached
    assert hit.usage.prompt_tokens_details.cached_tokens == 0  # the request with prompt logprobs recomputed it
    assert hit.choices[0].model_extra["prompt_logprobs"] == cold.choices[0].model_extra["prompt_logprobs"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs_and_token_ids(gateway):
    client = sync_client(gateway)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                          extra_body={**NO_EOS, "prompt_logprobs": 0, "return_token_ids": True})
    prompt_ids = post(gateway, "/tokenize", messages=MESSAGES)["tokens"]
    assert resp.model_extra["prompt_token_ids"] == prompt_ids
    prompt_lps = resp.model_extra["prompt_logprobs"]
    assert len(prompt_lps) == len(prompt_ids) and all(len(e) == 1 for e in prompt_lps[1:])
    token_ids = resp.choices[0].model_extra["token_ids"]
    assert len(token_ids) == 3
    assert post(gateway, "/detokenize", tokens=token_ids)["prompt"] == resp.choices[0].message.content


def test_continue_final_message_and_chat_echo(gateway):
    client = sync_client(gateway)
    messages = [*MESSAGES, {"role": "assistant", "content": "The sky is"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={**NO_EOS, **flags, "echo": True, "return_token_ids": True})
    assert resp.choices[0].message.content.startswith("The sky is")
    tokenized = post(gateway, "/tokenize", messages=messages, **flags)
    assert resp.model_extra["prompt_token_ids"] == tokenized["tokens"]
    assert post(gateway, "/detokenize", tokens=tokenized["tokens"])["prompt"].endswith("The sky is")
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              stream=True, extra_body={**NO_EOS, **flags, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == resp.choices[0].message.content
    # without the continuation the prompt ends with the generation prompt instead
    plain = post(gateway, "/tokenize", messages=messages)["tokens"]
    assert plain != tokenized["tokens"] and len(plain) > len(tokenized["tokens"])
    for bad in ({"continue_final_message": True}, {**flags, "messages": MESSAGES}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=bad.pop("messages", messages), max_tokens=1,
                                           extra_body=bad)
        assert err.value.body["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_last_ones(gateway):
    client = sync_client(gateway)
    ids = post(gateway, "/tokenize", prompt=LONG_PROMPT)["tokens"]
    resp = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True})
    assert resp.usage.prompt_tokens == 7 and resp.choices[0].model_extra["prompt_token_ids"] == ids[-7:]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_tokenize_detokenize_and_version_need_the_key(gateway):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(gateway.url + path, json=body).status_code == 401
    assert httpx.get(gateway.url + "/version").status_code == 401
    assert httpx.get(gateway.url + "/version", headers=AUTH).json()["version"] == "0.1.0"
    tokenized = post(gateway, "/tokenize", prompt="Hello world", return_token_strs=True)
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] > 0
    assert "".join(tokenized["token_strs"]) == "Hello world"
    assert post(gateway, "/detokenize", tokens=tokenized["tokens"])["prompt"] == "Hello world"
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, "model")):
        resp = httpx.post(gateway.url + path, json=body, headers=AUTH)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, resp.text


def test_continuous_usage_and_stop_reason(gateway):
    client = sync_client(gateway)
    chunks = list(client.completions.create(model=MODEL, prompt="Usage", max_tokens=6, stream=True, temperature=0,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body=NO_EOS))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-2].choices[0].model_extra["stop_reason"] is None  # length
    full = client.completions.create(model=MODEL, prompt="Usage", max_tokens=6, temperature=0, extra_body=NO_EOS)
    text = full.choices[0].text
    stop = text[2:5]
    by_string = client.completions.create(model=MODEL, prompt="Usage", max_tokens=6, temperature=0, stop=[stop],
                                          extra_body=NO_EOS)
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].model_extra["stop_reason"] == stop
    ids = post(gateway, "/tokenize", prompt=text)["tokens"]
    by_token = client.completions.create(model=MODEL, prompt="Usage", max_tokens=6, temperature=0,
                                         extra_body={**NO_EOS, "stop_token_ids": [ids[1]], "return_token_ids": True})
    choice = by_token.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[1]
    assert full.choices[0].model_extra["stop_reason"] is None


def test_cache_salt_isolates_within_one_key(gateway):
    client = sync_client(gateway)
    prompt = "Salted. " + LONG_PROMPT

    def cached(salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=body)
        return resp.usage.prompt_tokens_details.cached_tokens

    assert cached("a") == 0 and cached("a") > 100
    assert cached("b") == 0  # another salt under the same key shares nothing
    assert cached(None) == 0  # nor does the key's own salt
    other_key = sync_client(gateway, API_KEYS[1]).completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                                                     extra_body={"cache_salt": "a"})
    assert other_key.usage.prompt_tokens_details.cached_tokens == 0  # combined with the key's, never replacing it


def test_lenient_message_fields_and_strict_top_level(gateway):
    client = sync_client(gateway)
    messages = [{"role": "system", "content": "S", "name": "boss"},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
                 "name": "ann"},
                {"role": "assistant", "content": None, "refusal": "I cannot."},
                {"role": "assistant",
                 "content": [{"type": "refusal", "refusal": "No."}, {"type": "text", "text": "Ok"}]},
                {"role": "user", "content": "Go on"}]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices
    for extra, param in (({"frobnicate": 1}, "frobnicate"), ({"functions": [{"name": "f"}]}, "functions")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=extra)
        assert err.value.body["param"] == param and param in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": "x", "refusal": "no"}])
    assert err.value.body["param"] == "messages[0].refusal"


VLLM_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds")


def scrape(engine: Proc) -> dict[str, float]:
    """Each vLLM metric's value: gauges and counters as they are, histograms their count."""
    text = httpx.get(engine.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:") and not family.name.endswith("_created"):
            wanted = {"gauge": family.name, "counter": family.name + "_total", "histogram": family.name + "_count"}
            (sample,) = [s for s in family.samples if s.name == wanted[family.type]]
            assert sample.labels["model_name"] == MODEL
            values[family.name] = sample.value
    return values


def test_vllm_metric_names_move_under_load(gateway, dummy_engine):
    wait_engine_idle(dummy_engine)
    before = scrape(dummy_engine)
    assert sorted(before) == sorted(VLLM_METRICS) and before["vllm:num_requests_running"] == 0
    client = sync_client(gateway)
    started, release = threading.Barrier(5), threading.Event()

    def stream_one(i: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT + str(i), max_tokens=300, stream=True,
                                           extra_body=NO_EOS)
        next(iter(stream))
        started.wait()
        release.wait()
        stream.close()  # aborts the rest

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    during = scrape(dummy_engine)
    release.set()
    for t in threads:
        t.join()
    wait_engine_idle(dummy_engine)
    after = scrape(dummy_engine)
    assert during["vllm:num_requests_running"] >= 1 and during["vllm:kv_cache_usage_perc"] > 0
    assert during["vllm:time_to_first_token_seconds"] >= before["vllm:time_to_first_token_seconds"] + 4
    assert during["vllm:request_queue_time_seconds"] >= before["vllm:request_queue_time_seconds"] + 4
    assert during["vllm:inter_token_latency_seconds"] > before["vllm:inter_token_latency_seconds"]
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] < 1
    assert after["vllm:e2e_request_latency_seconds"] == before["vllm:e2e_request_latency_seconds"] + 4
    assert after["vllm:prefix_cache_queries"] > before["vllm:prefix_cache_queries"] + 4 * 100
    assert after["vllm:prefix_cache_hits"] >= before["vllm:prefix_cache_hits"]
    assert after["vllm:inter_token_latency_seconds"] >= during["vllm:inter_token_latency_seconds"]


def test_streamed_completion_logprobs_hold_the_sampled_token(gateway):
    """Issue 17's first defect, streamed: logprobs=k gives at most k + 1 entries, the sampled token's among
    them, over 50 tokens sampled at temperature 1.5."""
    chunks = list(sync_client(gateway).completions.create(model=MODEL, prompt="Logprobs", max_tokens=50,
                                                          temperature=1.5, seed=3, logprobs=2, stream=True,
                                                          extra_body=NO_EOS))
    entries = [(token, lp, top) for c in chunks for token, lp, top in
               zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs,
                   c.choices[0].logprobs.top_logprobs)]
    assert len(entries) == 50
    assert all(top[token] == lp and len(top) <= 3 for token, lp, top in entries)
