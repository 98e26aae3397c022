"""STAND-IN for helper "parsers"' module (issue 16): a minimal <think>…</think> splitter with the
interface's signature; the real module replaces this file."""

from __future__ import annotations

from collections.abc import Callable


class ReasoningParser:
    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False):
        self.start, self.end = start, end
        self._in = starts_in_reasoning
        self._seen_start = starts_in_reasoning
        self._buf = ""
        self._done = False

    def feed(self, text: str) -> tuple[str, str]:
        if self._done:
            return "", text
        self._buf += text
        reasoning = content = ""
        if not self._in:
            if self.start.startswith(self._buf.lstrip()) and len(self._buf.lstrip()) < len(self.start):
                return "", ""
            if self._buf.lstrip().startswith(self.start):
                self._in = True
                self._buf = self._buf.lstrip()[len(self.start):]
            else:
                self._done = True
                content, self._buf = self._buf, ""
                return "", content
        end = self._buf.find(self.end)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(self.end):]
            self._buf, self._done = "", True
            return reasoning, content
        keep = next((k for k in range(len(self.end) - 1, 0, -1) if self._buf.endswith(self.end[:k])), 0)
        reasoning = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        return (rest, "") if self._in and not self._done else ("", rest)


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: ReasoningParser(starts_in_reasoning=True),
    "qwen3": ReasoningParser,
}
