"""STAND-IN for helper "parsers"' module (issue 16): only the interface and a minimal Hermes parser, so
that the gateway's tool-call plumbing can be built and tested; the real module replaces this file."""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallParser(ABC):
    def __init__(self, tool_names: Collection[str]):
        self.tool_names = frozenset(tool_names)
        self._calls: list[ToolCall] = []

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def finish(self) -> ParsedDelta: ...

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str]):
        super().__init__(tool_names)
        self._buf = ""

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        content, calls = "", []
        while True:
            start = self._buf.find(self.START)
            if start < 0:
                keep = next((k for k in range(len(self.START) - 1, 0, -1) if self._buf.endswith(self.START[:k])), 0)
                content += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return ParsedDelta(content, tuple(calls))
            end = self._buf.find(self.END, start)
            if end < 0:
                content += self._buf[:start]
                self._buf = self._buf[start:]
                return ParsedDelta(content, tuple(calls))
            body = self._buf[start + len(self.START):end]
            try:
                obj = json.loads(body)
                name, args = obj["name"], obj["arguments"]
                assert name in self.tool_names
            except Exception:
                content += self._buf[:end + len(self.END)]
            else:
                content += self._buf[:start]
                call = ToolCall("call_" + "".join(secrets.choice(string.ascii_letters) for _ in range(24)), name,
                                json.dumps(args, ensure_ascii=False))
                calls.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
                self._calls.append(call)
            self._buf = self._buf[end + len(self.END):]

    def finish(self) -> ParsedDelta:
        rest, self._buf = self._buf, ""
        return ParsedDelta(rest)


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def detect_tool_parser(chat_template: str) -> str | None:
    return "hermes" if "<tool_call>" in chat_template else None
