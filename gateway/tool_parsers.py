"""Tool calls in one choice's output text: the model's own markup → OpenAI ``tool_calls``, incrementally.

One parser per choice (``TOOL_PARSERS[name](tool_names)``): :meth:`~ToolCallParser.feed` takes each text
delta and returns what can be shown now (:class:`ParsedDelta`); :meth:`~ToolCallParser.finish` flushes at
the end of the output; :attr:`~ToolCallParser.calls` lists the calls completed so far. Pure and
synchronous. With a reasoning parser, feed this parser the reasoning parser's *content* deltas.

How text is decided (the same for every split of the same output, so streaming and non-streaming agree):

- Content outside calls is released as it comes, except a tail that may still begin a call's marker.
- A call is a *block* (marker to end of its JSON). It is held whole until it is complete, then emitted at
  once: a first :class:`ToolCallDelta` with index, id and name (arguments ""), then one with the whole
  arguments text. The arguments text is ``json.dumps(obj, ensure_ascii=False)`` of the parsed arguments
  object, the same in :attr:`~ToolCallParser.calls`. Holding the block is what lets a call that turns out
  malformed, unterminated or naming an unknown function come back as content (its raw text, markup and
  all) instead of a call half-streamed already.
- Separators (whitespace; for Llama also ``;``) right before an accepted call, or between the last call
  and the end of the output, are dropped: the newlines around and between calls never show as content.
  Text after a call is content as written. A ParsedDelta may hold content and calls together; their
  order inside one delta is not significant.

Formats (the model's text, special tokens decoded into it: ``[TOOL_CALLS]`` and ``<|python_tag|>`` are
special tokens, so the detokenizer must keep them for these parsers to see the markers):

- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several in a row for parallel calls; text may precede them. A block ends at ``</tool_call>``.
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too),
  optionally after ``<|python_tag|>``, several separated by ``;``. The calls have no marker of their own,
  so the rule is: a ``{`` is read as a call only where the output starts (after whitespace), right after
  an accepted call, or after ``<|python_tag|>`` (which may follow content). A ``{`` after other text is
  content, and so is a JSON object that is not a call to a known function.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 / Nemo; one block holds all
  its calls and is accepted or returned as content as a whole), and the v11+ form
  ``[TOOL_CALLS]name[ARGS]{...}`` (also with ``[CALL_ID]id`` before ``[ARGS]``), one block per call.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

_ID_CHARS = string.ascii_letters + string.digits
WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int  # position of the call in this choice's tool_calls
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next chunk of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str = ""  # plain text to show as content
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A whole parsed call (non-streaming)."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class ToolCallParser(ABC):
    """Incremental parser of one choice's output text. Not thread-safe; one per choice.

    Never raises on model output: what is not a well-formed call to one of ``tool_names`` is content.
    """

    def __init__(self, tool_names: Collection[str]):
        self._tool_names = frozenset(tool_names)  # calls naming other functions stay content
        self._calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Take the next text delta; return what can be emitted now."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """End of output: flush held text; a malformed or unterminated call is returned as content."""

    @property
    def calls(self) -> list[ToolCall]:
        """Every call completed so far, in order."""
        return list(self._calls)


_OUTSIDE_STRING = re.compile(r'["\[\]{}]')
_INSIDE_STRING = re.compile(r'["\\]')


class _JsonSpan:
    """Where the JSON object or array that starts at ``start`` ends: brackets counted outside strings.

    Incremental over a growing text: each call scans only what is new. It finds the end of well-bracketed
    text, not valid JSON; ``json.loads`` judges the span afterwards.
    """

    __slots__ = ("pos", "depth", "in_string")

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string = start, 0, False

    def end(self, text: str) -> int | None:
        while True:
            if self.in_string:
                m = _INSIDE_STRING.search(text, self.pos)
                if m is None:
                    self.pos = len(text)
                    return None
                if m.group() == '"':
                    self.pos, self.in_string = m.end(), False
                elif m.end() < len(text):
                    self.pos = m.end() + 1  # an escape: skip the escaped character
                else:
                    self.pos = m.start()  # an escape at the very end: decided by the next character
                    return None
                continue
            m = _OUTSIDE_STRING.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return None
            self.pos = m.end()
            ch = m.group()
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return self.pos


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """``json.loads``, None when the text is not strict JSON (NaN and Infinity included)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:  # JSONDecodeError is one; RecursionError is left to _safe_parse
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (to hold it back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _BlockParser(ToolCallParser):
    """Content and call blocks, found by format hooks; holding, separators and emission are shared here."""

    separators = WHITESPACE  # dropped right before a call and after the last one
    START: str  # the marker that opens a block, for the formats that have one

    def __init__(self, tool_names: Collection[str]):
        super().__init__(tool_names)
        self._buf = ""  # undecided text: a possible start of a marker, or a block not complete yet
        self._in_block = False  # _buf starts with a block
        self._span: _JsonSpan | None = None  # the current block's JSON scan
        self._scanned = 0  # how far the current block has been searched for a closing marker
        self._pending = ""  # trailing separators of the content, held until what follows decides them
        self._quiet = True  # nothing but separators since the start or the last accepted call

    # -- format hooks (the first two find ``START``; a format without a marker overrides them) --------
    def _block_start(self, text: str) -> int | None:
        """Where in ``text`` (undecided content) a block starts, once its marker is whole; else None."""
        i = text.find(self.START)
        return i if i >= 0 else None

    def _held(self, text: str) -> int:
        """How many trailing characters of ``text`` (with no block start) might still begin one."""
        return partial_suffix(text, self.START)

    @abstractmethod
    def _block_end(self, text: str) -> int | None:
        """Length of the block that ``text`` starts with once it is decided; None: needs more text."""

    @abstractmethod
    def _parse_block(self, block: str) -> list[tuple[str, dict]] | None:
        """The block's calls as (name, arguments), or None when it is not a valid call block."""

    # -- shared ------------------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        out = self._advance(final=True)
        tail = "" if self._quiet and self._calls else self._pending  # separators after the last call: dropped
        self._pending = ""
        return ParsedDelta(out.content + tail, out.tool_calls)

    def _advance(self, final: bool) -> ParsedDelta:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._buf:
            if not self._in_block:
                start = self._block_start(self._buf)
                if start is None:
                    cut = len(self._buf) - (0 if final else self._held(self._buf))
                    self._text(self._buf[:cut], content)
                    self._buf = self._buf[cut:]
                    break
                self._text(self._buf[:start], content)
                self._buf, self._in_block = self._buf[start:], True
            end = self._block_end(self._buf)
            if end is None and not final:
                break
            block = self._buf if end is None else self._buf[:end]  # unterminated at the end: content
            self._buf = self._buf[len(block):]
            self._in_block, self._span, self._scanned = False, None, 0
            parsed = None if end is None else self._safe_parse(block)
            if parsed is None:
                self._text(block, content)
            else:
                self._accept(parsed, deltas)
        return ParsedDelta("".join(content), tuple(deltas))

    def _safe_parse(self, block: str) -> list[tuple[str, str]] | None:
        """The block's calls with their arguments serialized; None if any of them is not a valid call."""
        try:
            calls = [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in
                     self._parse_block(block) or ()]
            for _, arguments in calls:
                arguments.encode()  # a lone surrogate escape ("\ud800") cannot go out as UTF-8
        except (RecursionError, UnicodeEncodeError):  # (RecursionError: absurdly nested JSON)
            return None
        return calls or None

    def _text(self, text: str, out: list[str]) -> None:
        text = self._pending + text
        cut = len(text.rstrip(self.separators))
        if cut:
            out.append(text[:cut])
            self._quiet = False
        self._pending = text[cut:]

    def _accept(self, calls: list[tuple[str, str]], out: list[ToolCallDelta]) -> None:
        self._pending, self._quiet = "", True  # separators before the call touch it
        for name, arguments in calls:
            call = ToolCall(new_call_id(), name, arguments)
            index = len(self._calls)
            self._calls.append(call)
            out += (ToolCallDelta(index, call.id, name, ""), ToolCallDelta(index, arguments=arguments))

    def _json_end(self, text: str, start: int) -> int | None:
        if self._span is None:
            self._span = _JsonSpan(start)
        return self._span.end(text)

    def _call(self, obj: Any, argument_keys: tuple[str, ...]) -> tuple[str, dict] | None:
        """(name, arguments) of a call object ``{"name": ..., <argument key>: {...}}`` to a known tool."""
        if not isinstance(obj, dict) or obj.get("name") not in self._tool_names:
            return None
        key = next((k for k in argument_keys if k in obj), None)
        arguments = obj[key] if key else None
        return (obj["name"], arguments) if isinstance(arguments, dict) else None


def _skip(text: str, pos: int, chars: str = WHITESPACE) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class HermesParser(_BlockParser):
    START, END = "<tool_call>", "</tool_call>"

    def _block_end(self, text: str) -> int | None:
        i = text.find(self.END, max(len(self.START), self._scanned))
        if i < 0:
            self._scanned = max(len(self.START), len(text) - len(self.END) + 1)
            return None
        return i + len(self.END)

    def _parse_block(self, block: str) -> list[tuple[str, dict]] | None:
        call = self._call(_loads(block[len(self.START):-len(self.END)]), ("arguments",))
        return [call] if call else None


class Llama3JsonParser(_BlockParser):
    TAG = "<|python_tag|>"
    separators = WHITESPACE + ";"

    def _block_start(self, text: str) -> int | None:
        tag = text.find(self.TAG)
        if self._quiet:  # at the start or right after a call, a bare object is a call candidate
            i = _skip(text, 0, self.separators)
            if i < len(text) and text[i] == "{" and (tag < 0 or i < tag):
                return i
        return tag if tag >= 0 else None

    def _held(self, text: str) -> int:
        return partial_suffix(text, self.TAG)

    def _block_end(self, text: str) -> int | None:
        i = _skip(text, len(self.TAG) if text.startswith(self.TAG) else 0)
        if i == len(text):
            return None
        if text[i] != "{":
            return i  # a tag without a JSON object (e.g. built-in tool code): content
        return self._json_end(text, i)

    def _parse_block(self, block: str) -> list[tuple[str, dict]] | None:
        body = block.removeprefix(self.TAG)
        call = self._call(_loads(body), ("parameters", "arguments"))
        return [call] if call else None


class MistralParser(_BlockParser):
    START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def _block_end(self, text: str) -> int | None:
        i = _skip(text, len(self.START))
        if i == len(text):
            return None
        if text[i] == "[":  # v3 / Nemo: a JSON array of calls
            return self._json_end(text, i)
        args = text.find(self.ARGS, i)  # v11+: name[ARGS]{...}
        if args < 0:
            return None
        j = _skip(text, args + len(self.ARGS))
        if j == len(text):
            return None
        return self._json_end(text, j) if text[j] == "{" else j

    def _parse_block(self, block: str) -> list[tuple[str, dict]] | None:
        body = block[len(self.START):].lstrip(WHITESPACE)
        if body.startswith("["):
            items = _loads(body)
            if not isinstance(items, list):
                return None
            calls = [self._call(item, ("arguments",)) for item in items]
            return calls if all(calls) else None
        header, _, arguments = body.partition(self.ARGS)
        name = header.partition(self.CALL_ID)[0].strip()
        call = self._call({"name": name, "arguments": _loads(arguments)}, ("arguments",))
        return [call] if call else None


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

# What marks each format in a chat template. Qwen3-Coder's template also has <tool_call>, with XML inside.
_TEMPLATE_PROBES = {
    "hermes": lambda t: "<tool_call>" in t and "<function=" not in t,
    "llama3_json": lambda t: "<|start_header_id|>" in t
    and ("<|python_tag|>" in t or '"parameters": dictionary of argument name' in t),
    "mistral": lambda t: "[TOOL_CALLS]" in t,
}


def detect_tool_parser(chat_template: str) -> str | None:
    """The parser whose markup the template uses, when exactly one format's marks are in it; else None."""
    found = [name for name, probe in _TEMPLATE_PROBES.items() if probe(chat_template)]
    return found[0] if len(found) == 1 else None
