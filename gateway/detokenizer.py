"""One output sequence's text: incremental detokenization and stop strings.

Text is released only when it is whole UTF-8 (``tokenizers``' DecodeStream holds back the tokens of a
character that is not complete yet) and when it can no longer be the start of a stop string that the
next tokens complete. A stop string found across token boundaries ends the sequence and cuts the text
right before it (or right after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from gateway.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 4  # prompt tokens fed first so the first output token decodes in context


class SequenceText:
    __slots__ = ("_tokenizer", "_stream", "_skip_special", "_stops", "_holdback", "_include_stop",
                 "_min_tokens", "_pending", "text", "sent", "num_tokens", "stopped", "stop_str")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stops: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self._stops = stops
        self._holdback = max(map(len, stops), default=1) - 1
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._pending: list[int] = []  # tokens whose text the stream still holds back
        self.text = ""  # all text so far, cut at a stop string
        self.sent = 0  # characters of text already released
        self.num_tokens = 0  # tokens consumed (none after a stop string)
        self.stopped = False  # a stop string ended the sequence
        self.stop_str: str | None = None  # which one

    def add(self, token_ids: Sequence[int]) -> list[int]:
        """Consume tokens until a stop string matches; returns the text offset where each consumed token
        starts (so ``len(result)`` tokens were consumed)."""
        offsets = []
        for token_id in token_ids:
            if self.stopped:
                break
            offsets.append(len(self.text))
            self.num_tokens += 1
            piece = self._step(token_id)
            if piece is None:
                self._pending.append(token_id)
                continue
            self._pending.clear()
            start = len(self.text)
            self.text += piece
            if self._stops and self.num_tokens >= self._min_tokens:
                self._check_stops(start)
        return offsets

    def release(self) -> str:
        """Text that is now safe to send."""
        end = len(self.text) if self.stopped else len(self.text) - self._holdback
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> str:
        """The rest of the text when the sequence ends; a character left incomplete becomes U+FFFD."""
        if self._pending and not self.stopped:
            self.text += self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
            self._pending.clear()
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer.backend, token_id)
        except Exception as exc:
            # Non-monotonic UTF-8 output can leave DecodeStream with a prefix it cannot re-decode
            # (vllm-project/vllm#17448); a fresh stream from this token on recovers.
            if "Invalid prefix" not in str(exc):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            return self._stream.step(self._tokenizer.backend, token_id)

    def _check_stops(self, start: int) -> None:
        """Search only where the new text could complete a stop string."""
        best = -1
        best_stop = ""
        for stop in self._stops:
            idx = self.text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1 and (best == -1 or idx < best):
                best, best_stop = idx, stop
        if best != -1:
            self.text = self.text[: best + len(best_stop) if self._include_stop else best]
            self.stopped = True
            self.stop_str = best_stop
