"""Reasoning parsers on outputs as Qwen3 and DeepSeek-R1 write them: whole, and split at every boundary.

Also the chain the gateway runs for a choice: reasoning first, then the tool parser on the content deltas.
"""

from __future__ import annotations

import random

import pytest

from gateway.reasoning import REASONING_PARSERS, ReasoningParser
from gateway.tool_parsers import TOOL_PARSERS

THOUGHT = "Okay, the user asks for 2 + 2.\n\nThat is 4; no tool needed. 数学 🧮"

# (parser, output text, reasoning, content)
CASES = [
    ("qwen3", f"<think>\n{THOUGHT}\n</think>\n\nThe answer is **4**.\n", THOUGHT, "The answer is **4**.\n"),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    ("qwen3", "\n\nHi there!  ", "", "\n\nHi there!  "),  # no reasoning: the content is kept as written
    ("qwen3", "<think>\n\n</think>\n\nHi", "", "Hi"),
    ("qwen3", " \n<think>Short.</think>Hi", "Short.", "Hi"),
    ("qwen3", f"<think>\n{THOUGHT} and still", f"{THOUGHT} and still", ""),  # never closed: all reasoning
    ("qwen3", "Use <think> tags like <think>this</think>.", "", "Use <think> tags like <think>this</think>."),
    ("qwen3", "<think>a</think>b <think>c</think> </think>", "a", "b <think>c</think> </think>"),
    ("qwen3", "<think>ab</thi", "ab</thi", ""),
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "   ", "", "   "),
    ("qwen3", "", "", ""),
    ("deepseek_r1", f"{THOUGHT}\n</think>\n\nThe answer is 4.", THOUGHT, "The answer is 4."),
    ("deepseek_r1", f"<think>\n{THOUGHT}</think>The answer is 4.", THOUGHT, "The answer is 4."),
    ("deepseek_r1", f"\n{THOUGHT}\n", THOUGHT, ""),  # never closed: all reasoning
    ("deepseek_r1", "</think>Straight to the answer.", "", "Straight to the answer."),
    ("deepseek_r1", "<thin", "<thin", ""),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    outs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


def splits(text: str, rng: random.Random) -> list[list[str]]:
    """The text whole, one character at a time, cut in two at every boundary, and 20 random cuttings."""
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=IDS)
def test_split_whole_and_every_split(name, text, reasoning, content):
    assert run(REASONING_PARSERS[name](), [text]) == (reasoning, content)
    for pieces in splits(text, random.Random(text)):
        assert run(REASONING_PARSERS[name](), pieces) == (reasoning, content), pieces


def test_streams_as_it_comes_and_holds_only_a_possible_marker():
    parser = REASONING_PARSERS["qwen3"]()
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>\nStep one") == ("Step one", "")
    assert parser.feed(", step two.\n</thi") == (", step two.", "")  # the newline may end the reasoning
    assert parser.feed("nk>\n\n") == ("", "")
    assert parser.feed("Done") == ("", "Done")
    assert parser.feed(" </think> <") == ("", " </think> <")  # after the block, content passes untouched
    assert parser.finish() == ("", "")


def test_custom_markers():
    parser = ReasoningParser("<reasoning>", "</reasoning>")
    assert run(parser, list("<reasoning>why</reasoning>what")) == ("why", "what")


TOOL_TURN = (
    "<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'
)


def chain(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], str]:
    """Reasoning parser, then the hermes parser on its content: (reasoning, content, calls, streamed arguments)."""
    reasoning_parser, tool_parser = REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](["get_weather"])
    reasoning, outs = [], []
    for piece in pieces:
        r, c = reasoning_parser.feed(piece)
        reasoning.append(r)
        outs.append(tool_parser.feed(c))
    r, c = reasoning_parser.finish()
    reasoning.append(r)
    outs += [tool_parser.feed(c), tool_parser.finish()]
    calls = [(call.name, call.arguments) for call in tool_parser.calls]
    streamed = "".join(d.arguments for out in outs for d in out.tool_calls)
    return "".join(reasoning), "".join(out.content for out in outs), calls, streamed


def test_tool_call_after_reasoning_through_both_parsers():
    arguments = '{"location": "Paris", "unit": "celsius"}'
    expected = ("The user wants the weather in Paris; I should call get_weather.", "", [("get_weather", arguments)],
                arguments)
    for pieces in splits(TOOL_TURN, random.Random(0)):
        assert chain(pieces) == expected, pieces


def test_tool_markup_inside_reasoning_is_reasoning_text():
    text = '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>?</think>No call.'
    assert run(REASONING_PARSERS["qwen3"](), [text]) == (
        'Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>?', "No call.")
