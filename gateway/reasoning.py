"""Reasoning in one choice's output text: ``<think>…</think>`` → ``reasoning_content`` and content.

One parser per choice (``REASONING_PARSERS[name]()``): :meth:`~ReasoningParser.feed` takes each text delta
and returns ``(reasoning delta, content delta)``; :meth:`~ReasoningParser.finish` flushes. Pure and
synchronous; a tool parser, if any, reads the content deltas.

The rules (the same for every split of the same output, so streaming and non-streaming agree):

- Only one reasoning block, and only at the start: the output opens it with ``start`` (after whitespace),
  or the prompt already did (``starts_in_reasoning``, DeepSeek-R1 style: the template ends with
  ``<think>``; a ``<think>`` the model writes anyway is dropped). Otherwise the whole output is content
  (Qwen3 style: thinking disabled, or a model that did not think), kept as it is.
- The block ends at ``end``; when it never comes, everything after ``start`` is reasoning.
- Reasoning is trimmed of whitespace at both ends, and content after ``end`` of leading whitespace (the
  models write ``<think>\\n…\\n</think>\\n\\n``). Everything after ``end`` is content, verbatim otherwise.
- Text that may still begin a marker (``"</thi"`` at the end of a delta) is held until it is decided.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from gateway.tool_parsers import partial_suffix

_OPENING, _REASONING, _CONTENT_START, _CONTENT = range(4)


class ReasoningParser:
    """Splits one choice's output into reasoning and content. Not thread-safe; one per choice."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False):
        self.start, self.end, self.starts_in_reasoning = start, end, starts_in_reasoning
        self._state = _OPENING
        self._buf = ""  # undecided text: the opening, or a possible start of ``end``
        self._pending = ""  # trailing whitespace of the reasoning, held until more reasoning follows it
        self._reasoning_started = False

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next text delta; return the (reasoning, content) text that can be emitted now."""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: flush held text (an unterminated block is all reasoning)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content = ""
        if self._state == _OPENING:
            self._open(final)
        if self._state == _REASONING:
            i = self._buf.find(self.end)
            if i >= 0:
                self._reason(self._buf[:i], reasoning)
                self._buf, self._state = self._buf[i + len(self.end):], _CONTENT_START  # trailing whitespace: dropped
            else:
                cut = len(self._buf) - (0 if final else partial_suffix(self._buf, self.end))
                self._reason(self._buf[:cut], reasoning)
                self._buf = self._buf[cut:]
        if self._state == _CONTENT_START:
            self._buf = self._buf.lstrip()
            if self._buf:
                self._state = _CONTENT
        if self._state == _CONTENT:
            content, self._buf = self._buf, ""
        return "".join(reasoning), content

    def _open(self, final: bool) -> None:
        """Decide, once the opening text allows it, whether the output starts in reasoning."""
        head = self._buf.lstrip()
        if head.startswith(self.start):
            self._buf, self._state = head[len(self.start):], _REASONING
        elif final or (head and not self.start.startswith(head)):
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT

    def _reason(self, text: str, out: list[str]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        text = self._pending + text
        cut = len(text.rstrip())
        if cut:
            out.append(text[:cut])
        self._pending = text[cut:]


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": partial(ReasoningParser, starts_in_reasoning=True),
    "qwen3": ReasoningParser,
}
