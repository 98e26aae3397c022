"""Tool-call parsers on outputs as the models write them: whole, and split at every boundary and at random.

Every sample is checked for the exact content and calls, and for streaming: any split of the text gives
the same content, calls and arguments, and the deltas reassemble (index, id and name first) to the calls.
"""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolCallParser, detect_tool_parser

TOOLS = ("get_weather", "search_web")


def args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


SF_JSON = '{"location": "San Francisco, CA", "unit": "celsius"}'
PARIS_JSON = '{"location": "Paris"}'
SEARCH_JSON = '{"query": "kvgate tool calling", "max_results": 3}'
TRICKY_JSON = ('{"query": "a \\"quoted\\" } ] [ { C:\\\\tmp\\\\", "end": "\\"}", '
               '"lang": null, "n": [1, 2.5, -3e2], "ok": true}')
UNICODE_JSON = '{"location": "東京都 Zürich ✈️ 😀👍🏽", "note": "\\u00e9\\n\\t"}'

WEATHER_SF = ("get_weather", args(location="San Francisco, CA", unit="celsius"))
WEATHER_PARIS = ("get_weather", args(location="Paris"))
SEARCH = ("search_web", args(query="kvgate tool calling", max_results=3))
TRICKY = ("search_web", args(query='a "quoted" } ] [ { C:\\tmp\\', end='"}', lang=None, n=[1, 2.5, -3e2], ok=True))
UNICODE = ("get_weather", args(location="東京都 Zürich ✈️ 😀👍🏽", note="é\n\t"))


def hermes(name: str, arguments: str) -> str:
    """One call as Qwen2.5 / Qwen3 / Hermes write it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama(name: str, arguments: str, key: str = "parameters") -> str:
    return f'{{"name": "{name}", "{key}": {arguments}}}'


def nemo(*calls: tuple[str, str]) -> str:
    """Mistral v3 / Nemo: one array after [TOOL_CALLS]."""
    return "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


H_SF, H_SEARCH, H_UNKNOWN = hermes("get_weather", SF_JSON), hermes("search_web", SEARCH_JSON), hermes("rm_rf", "{}")
H_BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}\n</tool_call>'
L_PARIS = llama("get_weather", PARIS_JSON)
M_PARIS = "[TOOL_CALLS]get_weather[ARGS]" + PARIS_JSON  # Mistral v11+ (v13 drops [CALL_ID])

# (parser, output text, content, calls as (name, arguments JSON))
CASES = [
    # hermes
    ("hermes", H_SF, "", [WEATHER_SF]),
    ("hermes", H_SF + "\n" + H_SEARCH, "", [WEATHER_SF, SEARCH]),
    ("hermes", "I'll look that up for you.\n\n" + H_SF + "\n" + H_SEARCH + "\n", "I'll look that up for you.",
     [WEATHER_SF, SEARCH]),
    ("hermes", H_SF + "\n\nDone; ask for more.", "\n\nDone; ask for more.", [WEATHER_SF]),
    ("hermes", "Let me check.\n" + H_SF + "\nDone.", "Let me check.\nDone.", [WEATHER_SF]),
    ("hermes", "No calls: <tools> or <tool_ tags <tool_call", "No calls: <tools> or <tool_ tags <tool_call", []),
    ("hermes", H_BAD_JSON, H_BAD_JSON, []),
    ("hermes", hermes("get_weather", '"Paris"'), hermes("get_weather", '"Paris"'), []),
    ("hermes", hermes("get_weather", '{"x": NaN}'), hermes("get_weather", '{"x": NaN}'), []),
    ("hermes", H_UNKNOWN, H_UNKNOWN, []),
    ("hermes", H_SF + "\n" + H_UNKNOWN, "\n" + H_UNKNOWN, [WEATHER_SF]),  # the "\n" before content stays
    ("hermes", "Checking.\n" + H_SF[:60], "Checking.\n" + H_SF[:60], []),
    ("hermes", H_SF + "\n" + H_SEARCH[:-3], "\n" + H_SEARCH[:-3], [WEATHER_SF]),
    ("hermes", hermes("search_web", TRICKY_JSON), "", [TRICKY]),
    ("hermes", f'Voilà 👍\n<tool_call>{{"name": "get_weather", "arguments": {UNICODE_JSON}}}</tool_call>', "Voilà 👍",
     [UNICODE]),
    ("hermes", "   \n", "   \n", []),
    # llama3_json
    ("llama3_json", llama("get_weather", SF_JSON), "", [WEATHER_SF]),
    ("llama3_json", "\n\n<|python_tag|>" + L_PARIS, "", [WEATHER_PARIS]),
    ("llama3_json", llama("get_weather", PARIS_JSON, key="arguments"), "", [WEATHER_PARIS]),
    ("llama3_json", '{"type": "function", "name": "get_weather", "parameters": {"location": "Paris"}}; '
     + llama("search_web", SEARCH_JSON), "", [WEATHER_PARIS, SEARCH]),
    ("llama3_json", "Let me check the weather.\n<|python_tag|>" + L_PARIS + ";", "Let me check the weather.",
     [WEATHER_PARIS]),
    ("llama3_json", L_PARIS + "\n\nThe call is on its way.", "\n\nThe call is on its way.", [WEATHER_PARIS]),
    ("llama3_json", "Here is the call: " + L_PARIS, "Here is the call: " + L_PARIS, []),
    ("llama3_json", '{"answer": 42, "unit": "km"}', '{"answer": 42, "unit": "km"}', []),
    ("llama3_json", llama("get_weather", '{"location": Paris}'), llama("get_weather", '{"location": Paris}'), []),
    ("llama3_json", L_PARIS[:-1], L_PARIS[:-1], []),
    ("llama3_json", llama("rm_rf", "{}") + "; " + L_PARIS, llama("rm_rf", "{}") + "; " + L_PARIS, []),
    ("llama3_json", '<|python_tag|>print("hi")\n<|python_tag|>' + L_PARIS, '<|python_tag|>print("hi")',
     [WEATHER_PARIS]),  # a tag without an object is content
    ("llama3_json", llama("search_web", TRICKY_JSON), "", [TRICKY]),
    ("llama3_json", "<|python_tag|>" + llama("get_weather", UNICODE_JSON), "", [UNICODE]),
    ("llama3_json", "Fine; no call needed. <|python_", "Fine; no call needed. <|python_", []),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "a1B2c3D4e"}]', "",
     [WEATHER_PARIS]),
    ("mistral", nemo(("get_weather", SF_JSON), ("search_web", SEARCH_JSON)).replace("[{", " [{", 1), "",
     [WEATHER_SF, SEARCH]),
    ("mistral", "Sure, let me check.\n" + nemo(("get_weather", PARIS_JSON)) + "\n", "Sure, let me check.",
     [WEATHER_PARIS]),
    ("mistral", "[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]" + PARIS_JSON, "", [WEATHER_PARIS]),
    ("mistral", "On it." + M_PARIS + "[TOOL_CALLS]search_web[ARGS]" + SEARCH_JSON, "On it.", [WEATHER_PARIS, SEARCH]),
    ("mistral", nemo(("get_weather", PARIS_JSON))[:-1] + ",]", nemo(("get_weather", PARIS_JSON))[:-1] + ",]", []),
    ("mistral", nemo(("get_weather", PARIS_JSON), ("rm_rf", "{}")), nemo(("get_weather", PARIS_JSON), ("rm_rf", "{}")),
     []),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]"Paris" and more', '[TOOL_CALLS]get_weather[ARGS]"Paris" and more', []),
    ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}", "[TOOL_CALLS]rm_rf[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]"Paris"' + M_PARIS, '[TOOL_CALLS]get_weather[ARGS]"Paris"',
     [WEATHER_PARIS]),
    ("mistral", nemo(("get_weather", PARIS_JSON))[:-5], nemo(("get_weather", PARIS_JSON))[:-5], []),
    ("mistral", M_PARIS + "[TOOL_CALLS]search_web[ARG", "[TOOL_CALLS]search_web[ARG", [WEATHER_PARIS]),
    ("mistral", "[TOOL_CALLS]search_web[ARGS]" + TRICKY_JSON, "", [TRICKY]),
    ("mistral", nemo(("get_weather", UNICODE_JSON)), "", [UNICODE]),
    ("mistral", "Arrays look like [1, 2] and [TOOL_", "Arrays look like [1, 2] and [TOOL_", []),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces, then finish; checks that the deltas reassemble to ``parser.calls``."""
    outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    assert all(isinstance(out, ParsedDelta) for out in outs)
    assembled: list[list[str]] = []  # per call: id, name, arguments
    for delta in (d for out in outs for d in out.tool_calls):
        if delta.index == len(assembled):  # a call's first delta names it
            assert delta.id is not None and delta.id.startswith("call_") and len(delta.id) == 29
            assert delta.name is not None
            assembled.append([delta.id, delta.name, delta.arguments])
        else:
            assert delta.index == len(assembled) - 1 and delta.id is None and delta.name is None
            assembled[-1][2] += delta.arguments
    assert [tuple(a) for a in assembled] == [(c.id, c.name, c.arguments) for c in parser.calls]
    return "".join(out.content for out in outs), [(c.name, c.arguments) for c in parser.calls]


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """The text whole, one character at a time, cut in two at every boundary, and 20 random cuttings."""
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=IDS)
def test_parse_whole_and_every_split(name, text, content, calls):
    assert run(TOOL_PARSERS[name](TOOLS), [text]) == (content, calls)
    rng = random.Random(text)
    for pieces in splits(text, rng):
        assert run(TOOL_PARSERS[name](TOOLS), pieces) == (content, calls), pieces


def test_arguments_are_the_compact_dump_of_the_parsed_object():
    out = run(TOOL_PARSERS["hermes"](TOOLS), ['<tool_call>{"name":"get_weather","arguments":{ "a" :1,"b":"\\u00e9"}}'
                                              '</tool_call>'])
    assert out == ("", [("get_weather", '{"a": 1, "b": "é"}')])


def test_content_streams_as_it_comes_and_holds_only_a_possible_marker():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    assert parser.feed("Let me") == ParsedDelta("Let me")
    assert parser.feed(" check <tool_") == ParsedDelta(" check")  # " " waits: it may touch a call
    assert parser.feed("x> now") == ParsedDelta(" <tool_x> now")
    assert parser.feed("\n<tool_call>\n") == ParsedDelta()
    first = parser.feed('{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>')
    assert first.content == "" and [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_weather", ""), (0, None, '{"location": "Paris"}')]  # emitted when the block closes
    assert parser.finish() == ParsedDelta()


def test_unknown_tools_and_no_tools_leave_everything_content():
    assert run(TOOL_PARSERS["hermes"](()), [H_SF]) == (H_SF, [])
    assert run(TOOL_PARSERS["mistral"](["search_web"]), [M_PARIS]) == (M_PARIS, [])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_garbage_and_absurd_nesting_never_raise(name):
    deep = "[" * 50_000 + "]" * 50_000
    texts = [
        f"<tool_call>{deep}</tool_call>", f"[TOOL_CALLS]{deep}", f"<|python_tag|>{{\"a\": {deep}}}",
        '<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud800"}}</tool_call>',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"x": "\\ud800"}}]', "\\", '{"', "{\\", "[TOOL_CALLS]\\",
    ]
    rng = random.Random(name)
    alphabet = list('{}[]",:\\ ;\nab') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
                                           '"name": "get_weather"', '"arguments": {}']
    texts += ["".join(rng.choices(alphabet, k=40)) for _ in range(300)]
    for text in texts:
        content, calls = run(TOOL_PARSERS[name](TOOLS), [text])
        if not calls:
            assert content == text  # nothing is lost: what is not a call comes back as it was written
        assert run(TOOL_PARSERS[name](TOOLS), list(text) if len(text) < 100 else [text]) == (content, calls)


def test_calls_lists_completed_calls_only():
    parser = TOOL_PARSERS["hermes"](TOOLS)
    parser.feed(H_SF + "\n" + H_SEARCH[:20])
    assert [c.name for c in parser.calls] == ["get_weather"]
    parser.feed(H_SEARCH[20:])
    assert [c.name for c in parser.calls] == ["get_weather", "search_web"]
    assert len({c.id for c in parser.calls}) == 2


QWEN25_TEMPLATE = (
    '{%- if tools %}{{- "<|im_start|>system\\n" }}{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist '
    'with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}{%- endif %}'
)
QWEN3_CODER_TEMPLATE = (
    '{{- "\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n'
    '<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n'
    '</tool_call>" }}'
)
LLAMA31_TEMPLATE = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}{%- if builtin_tools is defined or tools is not none %}'
    '{{- "Environment: ipython\\n" }}{%- endif %}{{- \'Given the following functions, please respond with a JSON for a '
    'function call with its proper arguments that best answers the given prompt.\\n\\n\' }}{{- \'Respond in the format '
    '{"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    '{%- if builtin_tools is defined %}{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- endif %}'
)
MISTRAL_TEMPLATE = (
    "{%- elif message['role'] == 'assistant' %}{%- if message.get('tool_calls') %}{%- for tool_call in "
    "message.tool_calls %}{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[CALL_ID]' + tool_call.id }}"
    "{{- '[ARGS]' + tool_call['function']['arguments']|tojson }}{%- endfor %}{%- endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN25_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"),
    (QWEN3_CODER_TEMPLATE, None),  # <tool_call> with XML inside: not Hermes JSON
    (CHATML_TEMPLATE, None),
    ("", None),
    (QWEN25_TEMPLATE + MISTRAL_TEMPLATE, None),  # two formats' marks: ambiguous
    ("<|python_tag|> without the Llama 3 headers", None),
])
def test_detect_tool_parser(template, expected):
    assert detect_tool_parser(template) == expected
