"""The model's text side: tokenizer, chat template, cache-boundary probes and token strings.

The tokenizer and chat template come from the GGUF metadata or the HF directory, loaded once with
transformers. Converting a GGUF vocabulary takes seconds, so the converted fast tokenizer is cached
on disk. The hot path calls the Rust ``tokenizers.Tokenizer`` directly.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import os
import re
import shutil
import tempfile
import time
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import structlog
import tokenizers
from tokenizers.decoders import ByteLevel

from gateway.errors import APIError

log = structlog.get_logger("gateway.tokenizer")

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# A prompt continues a cached conversation when one of its last this many message prefixes is cached
# (a new turn appends an answer and a user message; an agent's, tool calls and results too).
CONTINUATION_LOOKBACK = 8


def load_hf_tokenizer(path: str, cache_dir: Path) -> Any:
    """A transformers fast tokenizer for a GGUF file (converted once, then cached) or an HF directory."""
    import transformers

    source = Path(path)
    start = time.perf_counter()
    if source.is_dir():
        tok = transformers.AutoTokenizer.from_pretrained(str(source))
        origin = "hf"
    else:
        stat = source.stat()
        key = hashlib.sha256(
            f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:"
            f"{tokenizers.__version__}".encode()
        ).hexdigest()[:24]
        cached = cache_dir / "tokenizers" / key
        if (cached / "tokenizer.json").is_file():
            tok = transformers.AutoTokenizer.from_pretrained(str(cached))
            origin = "cache"
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            _save_atomically(tok, cached)
            origin = "gguf"
    log.info("tokenizer_loaded", path=path, origin=origin, seconds=round(time.perf_counter() - start, 2),
             vocab_size=len(tok))
    return tok


def _save_atomically(tok: Any, target: Path) -> None:
    """Several gateways may start at once: each writes aside and renames; the first rename wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, target)
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ConversationTokens:
    """Token ids of recent conversations, keyed by their text through the last message (rendered
    without a generation prompt); least recently used out first, past ``max_tokens`` in all."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._entries: OrderedDict[str, array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> array | None:
        ids = self._entries.get(text)
        if ids is not None:
            self._entries.move_to_end(text)
        return ids

    def put(self, text: str, ids: list[int]) -> None:
        if text in self._entries or len(ids) > self.max_tokens:
            return
        self._entries[text] = array("i", ids)
        self.num_tokens += len(ids)
        while self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self._entries.popitem(last=False)[1])


class ChatPrompt(NamedTuple):
    text: str
    token_ids: list[int]
    cache_boundaries: list[int]  # token positions where the system prompt / the last message end


class Tokenizer:
    """One per process, used from the event loop; its token-bytes and system-probe caches grow on use.

    A multi-turn conversation is tokenized once: each chat prompt's tokens through its last message
    are kept (``conversation_cache_tokens`` in all, ~8 bytes each with the text), and the next turn,
    which renders as that text followed by an added token (``<|im_start|>``), tokenizes only what
    follows it (:meth:`_encode_continuing`).
    """

    def __init__(self, hf_tokenizer: Any, probe_cache_size: int = 1024,
                 conversation_cache_tokens: int = 4_000_000):
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.hf = hf_tokenizer
        self.backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        self.vocab_size = len(hf_tokenizer)
        try:
            self.chat_template: str | None = hf_tokenizer.get_chat_template()
        except ValueError:
            self.chat_template = None
        # apply_chat_template passes the special tokens to the template; so must we, for identical text.
        self._template_kwargs = dict(hf_tokenizer.special_tokens_map)
        # transformers' own sandboxed Jinja environment (filters, globals, extensions), compiled once.
        # Its render_jinja_template wrapper deep-copies every message on each call: for our plain
        # string dicts a no-op that costs as much as the rendering itself.
        self._template = _compile_jinja_template(self.chat_template) if self.chat_template else None
        self._added_tokens = self.backend.get_added_tokens_decoder()
        self._segment_starts: dict[int, bool] = {}
        self._conversations = ConversationTokens(conversation_cache_tokens)
        self._byte_decoder = (
            {c: b for b, c in bytes_to_unicode().items()} if isinstance(self.backend.decoder, ByteLevel) else None
        )
        self._token_bytes: dict[int, bytes] = {}
        self._probe_tokens = functools.lru_cache(maxsize=probe_cache_size)(self._probe_tokens_uncached)

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-level piece may be part of a UTF-8 character)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._token_bytes_uncached(token_id)
        return cached

    def _token_bytes_uncached(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_tokens:
            return piece.encode()
        if self._byte_decoder is not None:
            try:
                return bytes(self._byte_decoder[c] for c in piece)
            except KeyError:
                return piece.encode()
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # --- chat template ---

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Exactly ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``."""
        if self._template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._template_kwargs)
        except jinja2.TemplateError as exc:  # the template's raise_exception(): a message the model rejects
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    def chat_prompt(self, messages: list[dict[str, Any]]) -> ChatPrompt:
        """Render and tokenize, and probe where the system prompt and the last message end."""
        text = self.render(messages)
        ids, tail, tail_start = self._encode_continuing(messages, text)
        boundaries: list[int] = []
        num_system = 0
        while num_system < len(messages) and messages[num_system]["role"] == "system":
            num_system += 1
        if 0 < num_system < len(messages):
            key = tuple(tuple(sorted(m.items())) for m in messages[:num_system])
            self._add_boundary(boundaries, self._token_prefix(self._probe_tokens(key), text, ids), len(ids))
        last_text = self._render_probe(messages)
        if last_text is not None and text.startswith(last_text):
            end = self._split_before_added_token(tail, len(last_text) - tail_start)
            if end is None:  # no shortcut: tokenize the probe and compare
                end = self._token_prefix((last_text, self.encode(last_text, False)), text, ids)
            else:
                end += len(ids) - len(tail.ids)
            self._add_boundary(boundaries, end, len(ids))
            if end is not None and 0 < end < len(ids):
                self._conversations.put(last_text, ids[:end])
        log.debug("cache_boundaries", boundaries=boundaries, prompt_tokens=len(ids))
        return ChatPrompt(text, ids, boundaries)

    def _encode_continuing(self, messages: list[dict[str, Any]],
                           text: str) -> tuple[list[int], tokenizers.Encoding, int]:
        """The prompt's token ids, the encoding of the part tokenized now, and where in ``text`` it starts.

        When one of the last :data:`CONTINUATION_LOOKBACK` message prefixes is a cached conversation
        and the prompt goes on from its text with a token that always starts a segment
        (:meth:`_starts_segment`), only the rest is tokenized: the tokenizer splits the text there
        before anything else and tokenizes the pieces independently, so the ids are the cached ones
        followed by the rest's.
        """
        for k in range(len(messages) - 1, max(0, len(messages) - 1 - CONTINUATION_LOOKBACK), -1):
            prefix = self._render_probe(messages[:k])
            head = self._conversations.get(prefix) if prefix is not None and text.startswith(prefix) else None
            if head is not None:
                tail = self.backend.encode(text[len(prefix):], add_special_tokens=False)
                if tail.ids and tail.offsets[0][0] == 0 and self._starts_segment(tail.ids[0]):
                    return [*head, *tail.ids], tail, len(prefix)
                break
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding, 0

    def _starts_segment(self, token_id: int) -> bool:
        """Whether the tokenizer splits every text right before this token: an added token that
        takes no whitespace before it, matches within words and on the raw text, and that no added
        token can overlap from the left (as ``xy`` would ``yz``)."""
        known = self._segment_starts.get(token_id)
        if known is None:
            token = self._added_tokens.get(token_id)
            known = token is not None and not (token.lstrip or token.single_word or token.normalized)
            if known:
                c = token.content
                known = not any(other.content[j:].startswith(c) or c.startswith(other.content[j:])
                                for other in self._added_tokens.values() for j in range(1, len(other.content)))
            self._segment_starts[token_id] = known
        return known

    def _probe_tokens_uncached(self, key: tuple) -> tuple[str, list[int]] | None:
        text = self._render_probe([dict(items) for items in key])
        return None if text is None else (text, self.encode(text, add_special_tokens=False))

    def _render_probe(self, messages: list[dict[str, Any]]) -> str | None:
        """The messages rendered without a generation prompt; None if the template refuses them."""
        try:
            return self.render(messages, add_generation_prompt=False)
        except Exception:
            return None

    def _split_before_added_token(self, encoding: tokenizers.Encoding, end: int) -> int | None:
        """How many of the encoding's tokens lie before character ``end`` (where a probe's text ends),
        if a token that starts a segment (:meth:`_starts_segment`: ``<|im_start|>``, ...) begins
        right there; else None.

        Tokenizers split the text at added tokens before anything else, and tokenize the pieces
        between them independently, so the tokens before such a split are exactly those of the
        prefix alone: the probe's boundary without tokenizing it again. The offsets must show the
        split: the previous token ends at it and the added token starts there.
        """
        offsets = encoding.offsets
        n = bisect.bisect_left(offsets, (end,))
        if (0 < n < len(offsets) and offsets[n][0] == end and offsets[n - 1][1] == end
                and self._starts_segment(encoding.ids[n])):
            return n
        return None

    @staticmethod
    def _token_prefix(probe: tuple[str, list[int]] | None, text: str, ids: list[int]) -> int | None:
        """A probe's token count if it is a true prefix of the prompt, as text and as tokens."""
        if probe is None:
            return None
        probe_text, probe_ids = probe
        n = len(probe_ids)
        return n if text.startswith(probe_text) and ids[:n] == probe_ids else None

    @staticmethod
    def _add_boundary(boundaries: list[int], n: int | None, num_tokens: int) -> None:
        if n is not None and 0 < n < num_tokens and n not in boundaries:
            boundaries.append(n)
