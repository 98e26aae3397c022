"""Bad inputs against the real gateway: the right status, an OpenAI-shaped error, one log line, no traceback.
Also the auth matrix."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gw_harness import API_KEYS, lines_for

AUTH = {"Authorization": f"Bearer {API_KEYS[0]}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "tiny", "messages": MSGS, **fields}


def completion(**fields):
    return {"model": "tiny", "prompt": "hi", **fields}


# (case id, method, path, JSON body or raw bytes, extra headers, status, param, message fragment)
CASES = [
    ("malformed-json", "POST", CHAT, b'{"model": "tiny", "messages": [', {}, 400, None, "not valid JSON"),
    ("json-array", "POST", CHAT, b"[1, 2]", {}, 400, None, "must be a JSON object"),
    ("missing-messages", "POST", CHAT, {"model": "tiny"}, {}, 400, "messages", "field required"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), {}, 400, "messages", "at least 1 item"),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), {}, 400, "messages[0].role",
     "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("content-type-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), {}, 400,
     "messages[0].content", "must be a string or a list of content parts"),
    ("image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), {}, 400, "messages[0].content[0]",
     "'image_url' is not supported"),
    ("tool-message-without-id", "POST", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), {}, 400,
     "messages[0].tool_call_id", "required in tool messages"),
    ("legacy-functions", "POST", CHAT, chat(functions=[{"name": "f"}]), {}, 400, "functions",
     "functions is not supported"),
    ("response-format-type", "POST", CHAT, chat(response_format={"type": "xml"}), {}, 400, "response_format.type",
     "'text', 'json_object' or 'json_schema'"),
    ("unknown-field", "POST", CHAT, chat(frobnicate=True), {}, 400, "frobnicate", "unrecognized request argument"),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), {}, 400, "temperature", "valid number"),
    ("temperature-range", "POST", CHAT, chat(temperature=500), {}, 400, "temperature", "<= 100"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), {}, 400, "top_p", "> 0"),
    ("n-zero", "POST", CHAT, chat(n=0), {}, 400, "n", ">= 1"),
    ("max-tokens-zero", "POST", CHAT, chat(max_tokens=0), {}, 400, "max_tokens", ">= 1"),
    ("beyond-context", "POST", CHAT, chat(max_completion_tokens=5000), {}, 400, "max_tokens",
     "exceeds the model's context length of 1024"),
    ("top-logprobs-range", "POST", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs", "<= 20"),
    ("top-logprobs-alone", "POST", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs", "needs logprobs"),
    ("logit-bias-vocab", "POST", CHAT, chat(logit_bias={"999999": 5}), {}, 400, "logit_bias", "outside the vocabulary"),
    ("empty-stop", "POST", CHAT, chat(stop=["ok", ""]), {}, 400, "stop", "must not be empty"),
    ("stream-options-alone", "POST", CHAT, chat(stream_options={"include_usage": True}), {}, 400, "stream_options",
     "only allowed when stream is true"),
    ("seed-float", "POST", CHAT, chat(seed=1.5), {}, 400, "seed", "valid integer"),
    # numbers past what msgpack (64 bits) or the sampler (int32, fp32) can carry: a 400, never a 500
    ("top-k-2-pow-64", "POST", CHAT, chat(top_k=2**64), {}, 400, "top_k", "<= 2147483647"),
    ("top-k-huge", "POST", COMPLETIONS, completion(top_k=10**30), {}, 400, "top_k", "<= 2147483647"),
    ("seed-2-pow-64", "POST", CHAT, chat(seed=2**64), {}, 400, "seed", "<= 18446744073709551615"),
    ("seed-below-int64", "POST", CHAT, chat(seed=-(2**63) - 1), {}, 400, "seed", ">= -9223372036854775808"),
    ("repetition-penalty-huge", "POST", CHAT, chat(repetition_penalty=1e300), {}, 400, "repetition_penalty",
     "<= 10.0"),
    ("repetition-penalty-zero", "POST", CHAT, chat(repetition_penalty=0), {}, 400, "repetition_penalty", "> 0"),
    ("n-huge", "POST", CHAT, chat(n=2**70), {}, 400, "n", "n must be <= 128"),
    ("logit-bias-key-huge", "POST", CHAT, chat(logit_bias={str(2**70): 1}), {}, 400, "logit_bias", "outside"),
    ("stop-token-huge", "POST", CHAT, chat(stop_token_ids=[2**70]), {}, 400, "stop_token_ids", "outside"),
    ("min-tokens-huge", "POST", CHAT, chat(min_tokens=2**70), {}, 400, "min_tokens", "<="),
    ("max-tokens-huge", "POST", CHAT, chat(max_tokens=2**70), {}, 400, "max_tokens", "context length"),
    ("min-tokens-over-max", "POST", CHAT, chat(max_tokens=2, min_tokens=5), {}, 400, "min_tokens", "<= 2"),
    ("unknown-model", "POST", CHAT, chat(model="gpt-4o"), {}, 404, "model", "'gpt-4o' does not exist"),
    ("suffix", "POST", COMPLETIONS, completion(suffix="x"), {}, 400, "suffix", "not supported"),
    ("best-of", "POST", COMPLETIONS, completion(best_of=3), {}, 400, "best_of", "not supported"),
    ("empty-prompt", "POST", COMPLETIONS, completion(prompt=[]), {}, 400, "prompt", "must not be empty"),
    ("prompt-float", "POST", COMPLETIONS, completion(prompt=1.5), {}, 400, "prompt", "must be a string, a list of"),
    ("prompt-token-vocab", "POST", COMPLETIONS, completion(prompt=[1, 49152]), {}, 400, "prompt",
     "outside the vocabulary"),
    ("prompt-fills-context", "POST", COMPLETIONS, completion(prompt=[5] * 1024), {}, 400, "prompt",
     "leaves no room"),
    ("completion-logprobs-range", "POST", COMPLETIONS, completion(logprobs=21), {}, 400, "logprobs", "<= 20"),
    ("unknown-route", "POST", "/v1/embeddings", completion(), {}, 404, None, "no route POST /v1/embeddings"),
    ("wrong-method", "GET", CHAT, None, {}, 405, None, "method GET is not allowed"),
    ("body-too-large", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 70000}]), {}, 413, None,
     "exceeds the limit of 65536 bytes"),
    ("text-plain", "POST", CHAT, json.dumps(chat()).encode(), {"Content-Type": "text/plain"}, 415, None,
     "Content-Type must be application/json"),
    ("no-content-type", "POST", CHAT, json.dumps(chat()).encode(), {"Content-Type": ""}, 415, None,
     "Content-Type must be application/json"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(gateway, case):
    name, method, path, body, headers, status, param, fragment = case
    request_id = f"bad-{name}"
    send_headers = {**AUTH, "X-Request-Id": request_id, **headers}
    if isinstance(body, bytes):
        send_headers.setdefault("Content-Type", "application/json")
        resp = httpx.request(method, gateway.url + path, content=body, headers=send_headers, timeout=30)
    else:
        resp = httpx.request(method, gateway.url + path, json=body, headers=send_headers, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and fragment in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if status == 405:
        assert "POST" in resp.headers["allow"]
    # exactly one line at INFO or above (this gateway also logs DEBUG dumps): the request line, with the
    # error and no traceback
    (line,) = [x for x in lines_for(gateway, request_id) if x["level"] != "debug"]
    assert line["event"] == "request" and line["status"] == status and line["level"] == "info"
    assert line["error"] == error["message"] and "exception" not in line
    assert "Traceback" not in gateway.log_path.read_text()


def test_sdk_sees_typed_errors(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEYS[0], max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4096)
    assert bad.value.param == "max_tokens" and bad.value.code is None
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="x")
    assert missing.value.code == "model_not_found"


OPEN_PATHS = ["/health", "/ready", "/metrics"]
CLOSED = [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/openapi.json")]


@pytest.mark.parametrize("method, path", CLOSED)
@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", f"Basic {API_KEYS[0]}", "Bearer", API_KEYS[0]])
def test_auth_rejects_missing_and_wrong_keys(gateway, method, path, auth):
    headers = {"X-Request-Id": "auth-probe"} | ({"Authorization": auth} if auth is not None else {})
    resp = httpx.request(method, gateway.url + path, headers=headers, json=chat() if method == "POST" else None)
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert ("missing API key" if auth is None else "invalid API key") in error["message"]


@pytest.mark.parametrize("key", API_KEYS)
def test_auth_accepts_each_key(gateway, key):
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(gateway.url + "/v1/models", headers=headers).status_code == 200
    resp = httpx.post(gateway.url + COMPLETIONS, headers=headers, json=completion(max_tokens=1), timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path", OPEN_PATHS)
def test_open_paths_need_no_key(gateway, path):
    assert httpx.get(gateway.url + path).status_code == 200


def test_options_is_open(gateway):
    # No CORS here: the route answers 405, but auth must not be what stops it.
    assert httpx.options(gateway.url + CHAT).status_code == 405


async def test_sdk_auth_errors_sync_and_async(gateway):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="tiny", messages=MSGS)
    await client.close()
    ok = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=API_KEYS[1], max_retries=0)
    assert [m.id for m in (await ok.models.list()).data] == ["tiny"]
    await ok.close()


def test_auth_failures_log_one_line_without_the_key(gateway):
    httpx.get(gateway.url + "/v1/models", headers={"Authorization": "Bearer sk-leaked-guess", "X-Request-Id": "auth-1"})
    (line,) = [x for x in lines_for(gateway, "auth-1") if x["level"] != "debug"]
    assert line["status"] == 401 and line["error"] == "invalid API key" and "tenant" not in line
    assert "sk-leaked-guess" not in gateway.log_path.read_text()
