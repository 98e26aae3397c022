"""The model's text side: tokenizer, chat template, cache-boundary probes and token strings.

The tokenizer and chat template come from the GGUF metadata or the HF directory, loaded once with
transformers. Converting a GGUF vocabulary takes seconds, so the converted fast tokenizer is cached
on disk. The hot path calls the Rust ``tokenizers.Tokenizer`` directly.

Tools reach the prompt through the template: one that uses the ``tools`` variable gets them as
``apply_chat_template(tools=...)`` does, with the history's tool calls and tool messages as they are. A
template that does not (SmolLM2's) gets them the Hermes way, the format the ``hermes`` tool-call parser
reads (:func:`hermes_tool_messages`): the tools block at the end of the system message (a system message
of its own when there is none), an assistant's calls as ``<tool_call>`` lines in its content, and each
run of tool results as one user message of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.meta
import structlog
import tokenizers
from tokenizers.decoders import ByteLevel

from gateway.errors import APIError

log = structlog.get_logger("gateway.tokenizer")

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# A prompt continues a cached conversation when one of its last this many message prefixes is cached
# (a new turn appends an answer and a user message; an agent's, tool calls and results too).
CONTINUATION_LOOKBACK = 8
HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
HERMES_TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def load_hf_tokenizer(path: str, cache_dir: Path) -> Any:
    """A transformers fast tokenizer for a GGUF file (converted once, then cached) or an HF directory."""
    import transformers

    from engine.gguf_reader import transformers_reads_plainly

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
            with transformers_reads_plainly():
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


class ByteLRU:
    """A least-recently-used map bounded by the bytes of its keys and values (``nbytes`` given on
    ``put``), thread-safe: the tokenizer runs in several worker threads. An entry larger than the whole
    cache is not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.hits = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        with self._lock:
            if key in self._entries or nbytes > self.max_bytes:
                return
            self._entries[key] = (value, nbytes)
            self.num_bytes += nbytes
            while self.num_bytes > self.max_bytes:
                self.num_bytes -= self._entries.popitem(last=False)[1][1]


def _text_bytes(*texts: str) -> int:
    """Memory of the strings (CPython keeps 1, 2 or 4 bytes a character)."""
    return sum(sys.getsizeof(t) for t in texts)


class ChatPrompt(NamedTuple):
    text: str
    token_ids: list[int]
    cache_boundaries: list[int]  # token positions where the system prompt / the last message end


class Tokenizer:
    """One per process, thread-safe: requests render and tokenize in worker threads
    (:class:`gateway.workers.WorkerPool`).

    A multi-turn conversation is tokenized once: each chat prompt's tokens through its last message
    are kept, and the next turn, which renders as that text followed by an added token
    (``<|im_start|>``), tokenizes only what follows it (:meth:`_encode_continuing`). Those and the
    system-prompt probes share one cache of ``cache_bytes``, keyed by tenant as well as text: a tenant
    never gets the speed of another's entry, so timing tells nothing about what others sent.
    """

    def __init__(self, hf_tokenizer: Any, cache_bytes: int = 64 << 20, chat_template: str | None = None):
        """``chat_template``, when given, replaces the tokenizer's own (--chat-template)."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        from transformers.utils.chat_template_utils import _compile_jinja_template

        self.hf = hf_tokenizer
        self.backend: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.chat_template = chat_template
        if chat_template is None:
            try:
                self.chat_template = hf_tokenizer.get_chat_template()
            except ValueError:
                pass
        # apply_chat_template passes the special tokens to the template; so must we, for identical text.
        self._template_kwargs = dict(hf_tokenizer.special_tokens_map)
        # transformers' own sandboxed Jinja environment (filters, globals, extensions), compiled once.
        # Its render_jinja_template wrapper deep-copies every message on each call: for our plain
        # string dicts a no-op that costs as much as the rendering itself.
        self._template = _compile_jinja_template(self.chat_template) if self.chat_template else None
        self.renders_tools = self._template is not None and "tools" in jinja2.meta.find_undeclared_variables(
            self._template.environment.parse(self.chat_template))
        self._added_tokens = self.backend.get_added_tokens_decoder()
        self._segment_starts: dict[int, bool] = {}
        self._cache = ByteLRU(cache_bytes)
        self._byte_decoder = (
            {c: b for b, c in bytes_to_unicode().items()} if isinstance(self.backend.decoder, ByteLevel) else None
        )
        self._token_bytes: dict[int, bytes] = {}
        # A sound bound for the tokens of a text before tokenizing it: no token covers more characters.
        self.max_token_chars = max(max(len(self.token_bytes(i)), len(piece))
                                   for piece, i in self.backend.get_vocab(with_added_tokens=True).items())

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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               context: Mapping[str, Any] | None = None) -> str:
        """Exactly ``apply_chat_template(messages, tokenize=False, add_generation_prompt=..., **context)``;
        ``context`` holds ``tools`` and the request's chat_template_kwargs."""
        if self._template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        variables = {"tools": None, "documents": None, **self._template_kwargs, **(context or {})}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # the template's raise_exception(): a message the model rejects
            raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None

    def _template_inputs(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
                        template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict]:
        """The messages and variables the template renders: the tools in ``tools`` for a template that
        uses them, else written into the messages (:func:`hermes_tool_messages`)."""
        context = dict(template_kwargs or {})
        if not self.renders_tools:
            return hermes_tool_messages(messages, tools), context
        if tools:
            context["tools"] = list(tools)
        return messages, context

    def chat_prompt(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = (),
                    template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tenant: str | None = None) -> ChatPrompt:
        """Render and tokenize, and probe where the system prompt (with the tools the template puts
        there) and the last message end. ``continue_final_message`` cuts the text right after the
        final message's content, as ``apply_chat_template`` does, so the model continues it.
        ``tenant`` keys what this caches and reuses."""
        messages, context = self._template_inputs(messages, tools, template_kwargs)
        text = self.render(messages, add_generation_prompt, context=context)
        if continue_final_message:
            final = messages[-1]["content"].strip()
            if final not in text:
                raise APIError(400, "continue_final_message: the chat template does not render the final "
                                    "message's content", param="continue_final_message")
            text = text[: text.rindex(final) + len(final)]
        ids, tail, tail_start = self._encode_continuing(messages, text, context, tenant)
        boundaries: list[int] = []
        num_system = 0
        while num_system < len(messages) and messages[num_system]["role"] == "system":
            num_system += 1
        if 0 < num_system < len(messages):
            probe = self._system_probe(messages[:num_system], context, tenant)
            self._add_boundary(boundaries, self._token_prefix(probe, text, ids), len(ids))
        last_text = self._render_probe(messages, context)
        if last_text is not None and text.startswith(last_text):
            end = self._split_before_added_token(tail, len(last_text) - tail_start)
            if end is None:  # no shortcut: tokenize the probe and compare
                end = self._token_prefix((last_text, self.encode(last_text, False)), text, ids)
            else:
                end += len(ids) - len(tail.ids)
            self._add_boundary(boundaries, end, len(ids))
            if end is not None and 0 < end < len(ids):
                self._cache.put(("conversation", tenant, last_text), array("i", ids[:end]),
                                _text_bytes(last_text) + 4 * end)
        log.debug("cache_boundaries", boundaries=boundaries, prompt_tokens=len(ids))
        return ChatPrompt(text, ids, boundaries)

    def _encode_continuing(self, messages: list[dict[str, Any]], text: str, context: Mapping[str, Any],
                           tenant: str | None) -> tuple[list[int], tokenizers.Encoding, int]:
        """The prompt's token ids, the encoding of the part tokenized now, and where in ``text`` it starts.

        When one of the last :data:`CONTINUATION_LOOKBACK` message prefixes is a cached conversation
        and the prompt goes on from its text with a token that always starts a segment
        (:meth:`_starts_segment`), only the rest is tokenized: the tokenizer splits the text there
        before anything else and tokenizes the pieces independently, so the ids are the cached ones
        followed by the rest's. The cache is keyed by the rendered text, which holds the tools.
        """
        for k in range(len(messages) - 1, max(0, len(messages) - 1 - CONTINUATION_LOOKBACK), -1):
            prefix = self._render_probe(messages[:k], context)
            head = (self._cache.get(("conversation", tenant, prefix))
                    if prefix is not None and text.startswith(prefix) else None)
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

    def _system_probe(self, system: list[dict[str, Any]], context: Mapping[str, Any],
                      tenant: str | None) -> tuple[str, array] | None:
        """The system messages rendered alone and their tokens (None: the template refuses them), cached."""
        key = ("system", tenant, json.dumps([system, context], ensure_ascii=False))
        probe = self._cache.get(key)
        if probe is None:
            text = self._render_probe(system, context)
            if text is None:
                return None
            probe = (text, array("i", self.encode(text, add_special_tokens=False)))
            self._cache.put(key, probe, _text_bytes(key[2], text) + 4 * len(probe[1]))
        return probe

    def _render_probe(self, messages: list[dict[str, Any]], context: Mapping[str, Any]) -> str | None:
        """The messages rendered without a generation prompt; None if the template refuses them."""
        try:
            return self.render(messages, add_generation_prompt=False, context=context)
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
    def _token_prefix(probe: tuple[str, Sequence[int]] | None, text: str, ids: list[int]) -> int | None:
        """A probe's token count if it is a true prefix of the prompt, as text and as tokens."""
        if probe is None:
            return None
        probe_text, probe_ids = probe
        n = len(probe_ids)
        return n if text.startswith(probe_text) and ids[:n] == list(probe_ids) else None

    @staticmethod
    def _add_boundary(boundaries: list[int], n: int | None, num_tokens: int) -> None:
        if n is not None and 0 < n < num_tokens and n not in boundaries:
            boundaries.append(n)


def _tojson(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)  # as the templates' tojson filter writes it


def hermes_tool_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools, the history's tool calls and tool results written into plain messages, the way Qwen2.5's
    template writes them, for a template that does not render tools itself."""
    out: list[dict[str, Any]] = []
    previous_tool = False
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous_tool:  # a run of results is one user message, as parallel calls give them
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
            previous_tool = True
            continue
        previous_tool = False
        if m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{_tojson({'name': f['name'], 'arguments': f['arguments']})}\n</tool_call>"
                              for f in (c["function"] for c in m["tool_calls"]))
            content = f"{m['content']}\n{calls}" if m["content"] else calls
            m = {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": content}
        out.append(m)
    if tools:
        block = "\n".join([HERMES_TOOLS_HEADER, *(_tojson(t) for t in tools), HERMES_TOOLS_FOOTER])
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
