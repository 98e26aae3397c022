"""Tools and structured outputs on the request side: request → engine constraint (exact specs), tools and
tool history through the chat template (exact prompts: SmolLM2's template, which has no tools, and a
Qwen-style one, which has), cache boundaries with tools, the 400s, and end to end through the openai SDK
against a real gateway and tiny engine; the tests named ``test_constrained_*`` run SmolLM2 under the
engine's grammar masks (real weights and vocabulary), at temperature 0 and 1."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from gw_harness import API_KEYS, lines_for
from pydantic import BaseModel, Field
from test_tokenizer import RecordingBackend, make_template_tokenizer  # noqa: F401 — a fixture

from benchmarks.structured_cases import MAX_TOKENS, SCHEMAS
from engine.protocol import DEFAULT_MODEL_NAME, ModelLimits, StructuredOutput
from gateway.config import ConfigError, load_config
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.serving import tool_call_parser_name
from gateway.structured import NO_PARAMETERS, check_grammars, schema_text
from gateway.tokenizer import Tokenizer

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_HISTORY = [{"role": "system", "content": "Be brief."}, USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
LIMITS = ModelLimits(max_model_len=1024, vocab_size=49152)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def structured(req) -> StructuredOutput | None:
    """What the engine is sent, through sampling() as the serving calls it."""
    return req.sampling(None, None, 10, LIMITS, "top_logprobs").structured


def error_of(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


# --- request → constraint ---


def test_plain_requests_send_no_grammar():
    assert structured(request()) is None and structured(request(response_format={"type": "text"})) is None
    assert structured(request(tools=[WEATHER])) is None  # auto: the model may or may not call
    assert structured(request(tools=[WEATHER], tool_choice="none")) is None


def test_response_format_json_schema_and_json_object():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    req = request(response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                                          "strict": True}})
    assert structured(req) == StructuredOutput(
        "json_schema", '{"type":"object","properties":{"answer":{"type":"integer"}},"required":["answer"]}')
    assert structured(request(response_format={"type": "json_object"})) == StructuredOutput("json_object", "")
    no_schema = request(response_format={"type": "json_schema", "json_schema": {"name": "any"}})
    assert structured(no_schema) == StructuredOutput("json_object", "")


@pytest.mark.parametrize("given, expected", [
    ({"json": {"type": "boolean"}}, StructuredOutput("json_schema", '{"type":"boolean"}')),
    ({"json": '{"type": "boolean"}'}, StructuredOutput("json_schema", '{"type": "boolean"}')),
    ({"regex": r"\d{3}-[a-z]+"}, StructuredOutput("regex", r"\d{3}-[a-z]+")),
    ({"choice": ["yes", "no", "mäybe"]}, StructuredOutput("choice", '["yes", "no", "mäybe"]')),
    ({"grammar": 'root ::= "a" | "b"'}, StructuredOutput("grammar", 'root ::= "a" | "b"')),
])
def test_structured_outputs_kinds_in_chat_and_completions(given, expected):
    assert structured(request(structured_outputs=given)) == expected
    completion = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": given})
    assert completion.sampling(4, None, 1, LIMITS, "logprobs").structured == expected


def test_required_tool_choice_is_an_array_of_calls_any_of_the_tools():
    item = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMS},
            "required": ["name", "arguments"]}
    no_args = {"type": "object", "properties": {"name": {"const": "get_time"}, "arguments": NO_PARAMETERS},
               "required": ["name", "arguments"]}
    parallel = structured(request(tools=[WEATHER, TIME], tool_choice="required"))
    assert parallel == StructuredOutput("json_schema", schema_text(
        {"type": "array", "items": {"anyOf": [item, no_args]}, "minItems": 1, "maxItems": 2}))
    single = structured(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert json.loads(single.spec) == {"type": "array", "items": {"anyOf": [item, no_args]}, "minItems": 1,
                                       "maxItems": 1}
    check_grammars([request(tools=[WEATHER, TIME], tool_choice="required").constraint])


def test_named_tool_choice_is_the_arguments_schema():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert structured(request(tools=[TIME, WEATHER], tool_choice=named)) == StructuredOutput(
        "json_schema", schema_text(WEATHER_PARAMS))
    time_named = {"type": "function", "function": {"name": "get_time"}}
    assert structured(request(tools=[TIME], tool_choice=time_named)).spec == '{"type":"object","properties":{}}'


def test_required_calls_move_each_tools_defs_to_the_root():
    class Address(BaseModel):
        street: str

    class Person(BaseModel):
        name: str
        home: Address

    tool = openai.pydantic_function_tool(Person)  # refs into its own $defs, as the SDK writes them
    spec = json.loads(structured(request(tools=[tool], tool_choice="required")).spec)
    assert spec["$defs"] == {"Person.Address": tool["function"]["parameters"]["$defs"]["Address"]}
    arguments = spec["items"]["anyOf"][0]["properties"]["arguments"]
    assert "$defs" not in arguments and arguments["properties"]["home"] == {"$ref": "#/$defs/Person.Address"}
    check_grammars([request(tools=[tool], tool_choice="required").constraint])


def test_tool_use_and_what_the_template_is_given():
    auto = request(tools=[WEATHER]).tool_use
    assert auto.mode == "auto" and auto.tools == (WEATHER,) and auto.names == ["get_weather"] and auto.parallel
    assert request(tools=[WEATHER], tool_choice="none").tool_use.tools == ()  # not shown: must not call
    assert request().tool_use.mode == "none"
    given = {"type": "function", "function": {"name": "f", "description": None, "strict": False}}
    assert request(tools=[given]).tool_use.tools == ({"type": "function", "function": {"name": "f",
                                                                                        "strict": False}},)


@pytest.mark.parametrize("fields, param, fragment", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "response_format cannot be combined with tool_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "cannot be combined with response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "must not be empty"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format", "and only then"),
])
def test_contradicting_constraints_are_400s(fields, param, fragment):
    err = error_of(lambda: structured(request(**fields)))
    assert err.param == param and fragment in err.message


def test_grammar_checks_name_the_field():
    cases = [
        (request(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectz"}}}),
         "response_format",
         'response_format.json_schema.schema is not a valid JSON schema: Unsupported type "objectz"'),
        (request(structured_outputs={"regex": "(?=a)b"}), "structured_outputs",
         "structured_outputs.regex is not a supported regular expression: Regex parsing error at position 3: "
         "Lookahead is not supported yet."),
        (request(structured_outputs={"grammar": 'root ::= "a" |'}), "structured_outputs",
         "structured_outputs.grammar is not a valid EBNF grammar: EBNF parser error at line 1, column 15"),
        (request(structured_outputs={"json": "{not json"}), "structured_outputs",
         "structured_outputs.json is not a valid JSON schema: Failed to parse JSON"),
        (request(tools=[TIME, {"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]),
         "tools", "tools[1].function.parameters is not a valid JSON schema: properties must be an object"),
    ]
    for req, param, message in cases:
        err = error_of(lambda req=req: check_grammars(req.grammar_checks()))
        assert err.param == param and err.message.startswith(message), err.message


# --- template rendering ---


def rendered(tok: Tokenizer, openai_messages: list[dict], tools=(), **kwargs):
    req = ChatCompletionRequest.model_validate({"messages": openai_messages})
    return tok.chat_prompt(req.template_messages(), tools, kwargs)


SMOLLM_TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, '
    '"required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time"}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def test_smollm2_template_gets_tools_and_tool_history_the_hermes_way(tokenizer):
    assert not tokenizer.renders_tools  # SmolLM2's template does not use `tools`
    history = [*TOOL_HISTORY, {"role": "tool", "tool_call_id": "call_2", "content": "{\"time\": \"12:00\"}"}]
    prompt = rendered(tokenizer, history, (WEATHER, TIME))
    assert prompt.text == (
        f"<|im_start|>system\nBe brief.\n\n{SMOLLM_TOOLS_BLOCK}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        '<tool_response>\n{"time": "12:00"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    assert prompt.token_ids == tokenizer.encode(prompt.text, False)


def test_smollm2_without_a_system_message_gets_one_with_the_tools(tokenizer):
    text = rendered(tokenizer, [USER], (WEATHER, TIME)).text
    assert text == (f"<|im_start|>system\n{SMOLLM_TOOLS_BLOCK}<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_an_assistant_message_with_text_and_calls(tokenizer):
    messages = [USER, {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, {**CALL, "id": "c2"}]}]
    text = rendered(tokenizer, messages).text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\nChecking.\n{call}\n{call}<|im_end|>\n" in text


QWEN_STYLE = (  # Qwen2.5's tool handling, the Hermes format
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools><|im_end|>\\n\" }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen_style(make_template_tokenizer):  # noqa: F811
    return make_template_tokenizer(QWEN_STYLE)


def reference_messages(openai_messages: list[dict]) -> list[dict]:
    return ChatCompletionRequest.model_validate({"messages": openai_messages}).template_messages()


def test_a_template_with_tools_renders_them_as_apply_chat_template(qwen_style):
    tok, hf = qwen_style
    assert tok.renders_tools
    prompt = rendered(tok, TOOL_HISTORY, (WEATHER, TIME))
    reference = hf.apply_chat_template(reference_messages(TOOL_HISTORY), tools=[WEATHER, TIME], tokenize=False,
                                       add_generation_prompt=True)
    assert prompt.text == reference
    assert prompt.text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME)
        + "\n</tools><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert prompt.token_ids == list(hf.apply_chat_template(
        reference_messages(TOOL_HISTORY), tools=[WEATHER, TIME], tokenize=True, add_generation_prompt=True,
        return_dict=False))


def test_chat_template_kwargs_reach_the_template(qwen_style):
    tok, hf = qwen_style
    thinking_off = rendered(tok, [USER], enable_thinking=False).text
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking_off == hf.apply_chat_template([USER], tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
    assert rendered(tok, [USER], enable_thinking=True).text.endswith("<|im_start|>assistant\n")
    err = error_of(lambda: request(chat_template_kwargs={"tools": []}).template_kwargs())
    assert err.param == "chat_template_kwargs" and "'tools'" in err.message


# --- cache boundaries with tools ---


def decoded(tok: Tokenizer, prompt, start: int | None, end: int | None) -> str:
    return tok.decode(prompt.token_ids[start:end], skip_special_tokens=False)


@pytest.mark.parametrize("template", ["smollm2", "qwen"])
def test_boundaries_end_the_tools_block_and_the_last_tool_message(tokenizer, qwen_style, template):
    tok = tokenizer if template == "smollm2" else qwen_style[0]
    prompt = rendered(tok, TOOL_HISTORY, (WEATHER, TIME))
    system_end, last_end = prompt.cache_boundaries
    assert decoded(tok, prompt, None, system_end).endswith("</tools><|im_end|>\n" if template == "qwen"
                                                           else "</tool_call><|im_end|>\n")
    assert decoded(tok, prompt, system_end, last_end).endswith("18 C, sunny\n</tool_response><|im_end|>\n")
    assert decoded(tok, prompt, last_end, None) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("template", ["smollm2", "qwen"])
def test_conversations_sharing_a_tool_set_share_the_prefix_through_the_tools(tokenizer, qwen_style, template):
    tok = tokenizer if template == "smollm2" else qwen_style[0]
    system = {"role": "system", "content": "You are an agent."}
    one = rendered(tok, [system, {"role": "user", "content": "first"}], (WEATHER, TIME))
    two = rendered(tok, [system, {"role": "user", "content": "second"}], (WEATHER, TIME))
    other = rendered(tok, [system, {"role": "user", "content": "first"}], (TIME,))
    b = one.cache_boundaries[0]
    assert two.cache_boundaries[0] == b and two.token_ids[:b] == one.token_ids[:b]
    assert other.token_ids[:b] != one.token_ids[:b]


def test_a_tool_loop_is_tokenized_once_and_keyed_by_the_tools(hf_tokenizer):
    tok = Tokenizer(hf_tokenizer)
    tok.backend = RecordingBackend(tok.backend)
    messages = list(TOOL_HISTORY)
    first = rendered(tok, messages, (WEATHER,))
    messages += [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "call_2"}]},
                 {"role": "tool", "tool_call_id": "call_2", "content": "19 C"}]
    tok.backend.texts.clear()
    second = rendered(tok, messages, (WEATHER,))
    encoded = list(tok.backend.texts)
    b = first.cache_boundaries[-1]
    assert encoded == [second.text[len(tok.decode(first.token_ids[:b], False)):]]  # only the new part
    assert second.token_ids[:b] == first.token_ids[:b] and second.token_ids == tok.encode(second.text, False)
    tok.backend.texts.clear()
    other_tools = rendered(tok, messages, (TIME,))  # another text: the cached conversation does not apply
    assert other_tools.text in tok.backend.texts and other_tools.token_ids == tok.encode(other_tools.text, False)


# --- through the gateway ---


def chat(**fields):
    return {"model": "tiny", "messages": [USER], "max_tokens": 2, **fields}


BAD = [
    ("bad-schema", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectz"}}}), "response_format", "not a valid JSON schema"),
    ("bad-regex", chat(structured_outputs={"regex": "(a)\\1"}), "structured_outputs", "Backreference"),
    ("bad-grammar", chat(structured_outputs={"grammar": "root ::= foo"}), "structured_outputs",
     'Rule "foo" is not defined'),
    ("unknown-tool", chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice", "not among the tools"),
    ("bad-tool-schema", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "integer", "minimum": "x"}}}]), "tools", "tools[0].function.parameters is not a valid JSON schema"),
    ("format-and-required", chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "cannot be combined"),
    ("tool-choice-word", chat(tools=[WEATHER], tool_choice="always"), "tool_choice", 'must be "none", "auto"'),
    ("tool-without-type", chat(tools=[{"function": {"name": "f"}}]), "tools[0].type", "field required"),
    ("tool-message-without-id", chat(messages=[USER, {"role": "tool", "content": "x"}]), "messages[1].tool_call_id",
     "required in tool messages"),
    ("bad-arguments", chat(messages=[USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ("calls-on-a-user", chat(messages=[{**USER, "tool_calls": [CALL]}]), "messages[0].tool_calls",
     "only assistant messages"),
    ("legacy-functions", chat(functions=[{"name": "f"}]), "functions", "functions is not supported"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_tool_and_format_inputs_are_400s_naming_the_field(gateway, case):
    name, body, param, fragment = case
    request_id = f"bad-tools-{name}"
    resp = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEYS[0]}", "X-Request-Id": request_id})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    (line,) = [x for x in lines_for(gateway, request_id) if x["level"] != "debug"]
    assert line["status"] == 400 and "exception" not in line


def client(gateway, key: str = API_KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_sdk_sees_tool_errors_typed(gateway):
    with pytest.raises(openai.BadRequestError) as bad:
        client(gateway).chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER],
                                                tool_choice={"type": "function", "function": {"name": "nope"}})
    assert bad.value.param == "tool_choice"


def test_tools_reach_the_prompt_and_none_hides_them(gateway, tokenizer):
    sdk = client(gateway)
    args = dict(model="tiny", messages=[USER], max_tokens=2, extra_body={"ignore_eos": True})
    plain = sdk.chat.completions.create(**args).usage.prompt_tokens
    with_tools = sdk.chat.completions.create(**args, tools=[WEATHER, TIME])
    none = sdk.chat.completions.create(**args, tools=[WEATHER, TIME], tool_choice="none").usage.prompt_tokens
    assert with_tools.usage.prompt_tokens == len(rendered(tokenizer, [USER], (WEATHER, TIME)).token_ids) > plain
    assert none == plain
    assert with_tools.choices[0].finish_reason == "length"  # the dummy model wrote no call


def test_an_agent_loop_resumes_each_turn_at_the_previous_last_message(gateway, tokenizer):
    """Five turns of call → result → next turn: each prompt is cached at least through the previous
    prompt's last message (its probed boundary), tools block included."""
    sdk = client(gateway, API_KEYS[1])
    messages = [{"role": "system", "content": "Agent loop test. " * 8}, {"role": "user", "content": "Plan a trip."}]
    previous_boundary = None
    for turn in range(5):
        resp = sdk.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=2,
                                           temperature=1.0, seed=turn, extra_body={"ignore_eos": True})
        expected = rendered(tokenizer, messages, (WEATHER, TIME))
        assert resp.usage.prompt_tokens == len(expected.token_ids)
        if previous_boundary is not None:
            assert resp.usage.prompt_tokens_details.cached_tokens >= previous_boundary
        previous_boundary = expected.cache_boundaries[-1]
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": f"City {turn}"})}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"{10 + turn} C"}]


def test_conversations_sharing_a_tool_set_share_their_cached_prefix(gateway, tokenizer):
    sdk = client(gateway)
    tools = [{"type": "function", "function": {"name": "lookup_order", "description": "An order by id " * 20,
                                               "parameters": {"type": "object", "properties": {
                                                   "order_id": {"type": "string"}}}}}]
    usages, boundaries = [], []
    for question in ("Where is order 1?", "Cancel order 2."):
        messages = [{"role": "user", "content": question}]
        usages.append(sdk.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=1,
                                                  extra_body={"ignore_eos": True}).usage)
        boundaries.append(rendered(tokenizer, messages, tools).cache_boundaries[0])
    assert boundaries[0] == boundaries[1] > 100
    assert usages[0].prompt_tokens_details.cached_tokens < boundaries[0]
    assert usages[1].prompt_tokens_details.cached_tokens >= boundaries[0]


# --- constrained generation end to end: SmolLM2 under the engine's grammar masks ---


class Weather(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=10)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.mark.slow
async def test_constrained_required_tool_choice_calls_validate(smollm2_gateway):
    """Greedy, and ten seeded samples, all at once (the engine batches them)."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    sdk = openai.AsyncOpenAI(base_url=smollm2_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    responses = await asyncio.gather(*(
        sdk.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[USER], tools=[tool], tool_choice="required",
                                    max_tokens=300, temperature=temperature, seed=seed)
        for temperature, seed in [(0.0, 0), *((1.0, seed) for seed in range(10))]))
    await sdk.close()
    for resp in responses:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            Weather.model_validate_json(call.function.arguments)


@pytest.mark.slow
def test_constrained_named_tool_choice_streams_as_the_whole_call(smollm2_gateway):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    sdk = client(smollm2_gateway)
    args = dict(model=DEFAULT_MODEL_NAME, messages=[USER], tools=[tool, TIME], max_tokens=300, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = sdk.chat.completions.create(**args)
    with sdk.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion()
    calls = [[(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
             for r in (whole, streamed)]
    assert calls[0] == calls[1] and len(calls[0]) == 1 and whole.choices[0].finish_reason == "tool_calls"
    Weather.model_validate_json(calls[0][0][1])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_parse_returns_the_pydantic_object(smollm2_gateway, temperature):
    sdk = client(smollm2_gateway)
    for model in (Weather, Verdict):
        resp = sdk.chat.completions.parse(model=DEFAULT_MODEL_NAME, messages=[USER], response_format=model,
                                          max_tokens=300, temperature=temperature, seed=3)
        assert isinstance(resp.choices[0].message.parsed, model)


@pytest.mark.slow
def test_constrained_structured_outputs_regex_and_choice(smollm2_gateway):
    sdk = client(smollm2_gateway)
    for body, check in [({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
                        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no"))]:
        resp = sdk.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=[USER], max_tokens=50,
                                           temperature=1.0, seed=1, extra_body={"structured_outputs": body})
        assert check(resp.choices[0].message.content) and resp.choices[0].finish_reason == "stop"


@pytest.mark.slow
async def test_constrained_parse_of_the_ten_benchmark_schemas(smollm2_gateway):
    sdk = openai.AsyncOpenAI(base_url=smollm2_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def parsed(model, prompt, temperature):
        resp = await sdk.chat.completions.parse(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": prompt}], response_format=model,
            max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
        return resp.choices[0].message.parsed

    cases = [(model, prompt, temperature) for temperature in (0.0, 1.0) for model, prompt in SCHEMAS.values()]
    results = await asyncio.gather(*(parsed(*case) for case in cases))
    await sdk.close()
    assert [type(r) for r in results] == [model for model, _, _ in cases]


def test_parser_settings(tokenizer):
    config = load_config(["--engine", "http://127.0.0.1:1"], environ={})
    assert (config.tool_call_parser, config.reasoning_parser) == ("auto", "none")
    config = load_config(["--engine", "http://127.0.0.1:1", "--tool-call-parser", "hermes"],
                         environ={"KVGATE_REASONING_PARSER": "qwen3"})
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    with pytest.raises(ConfigError, match="--tool-call-parser='nope': must be one of auto, "):
        load_config(["--engine", "http://127.0.0.1:1", "--tool-call-parser", "nope"], environ={})
    assert tool_call_parser_name("auto", tokenizer.chat_template) == "hermes"  # the format it is given tools in
    assert tool_call_parser_name("hermes", None) == "hermes"
