"""Structured outputs in the engine: grammars compiled with xgrammar against the model's vocabulary.

:class:`Grammars` (one per engine) compiles a request's :class:`StructuredOutput`;
:func:`new_matcher` makes each constrained sequence its own ``xgr.GrammarMatcher``; the sampler's
:class:`TokenMasks` fills the bitmasks of a step's constrained rows and applies them to the logits
in one call, and ``Scheduler.update`` has each matcher accept its sampled token. Rows without a
matcher never reach any of this.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch
import xgrammar as xgr

from engine.protocol import ProtocolError, StructuredOutput, grammar_error_message

GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept (LRU); a typical JSON schema takes 100-200 KiB
NO_VOCABULARY = "this engine's model has no tokenizer vocabulary: structured output is unavailable"



def _choice_grammar(compiler: xgr.GrammarCompiler, spec: str) -> xgr.CompiledGrammar:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choice must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty JSON list of strings")
    # EBNF string literals take JSON's escapes.
    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


# One line, ", " and ": " separators: a small model that may put whitespace anywhere can loop on it.
_COMPILE: dict[str, Callable[[xgr.GrammarCompiler, str], xgr.CompiledGrammar]] = {
    "json_schema": lambda c, spec: c.compile_json_schema(spec, any_whitespace=False),
    "json_object": lambda c, _: c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False),
    "regex": lambda c, spec: c.compile_regex(spec),
    "choice": _choice_grammar,
    "grammar": lambda c, spec: c.compile_grammar(spec),
}


class Grammars:
    """The grammar compiler of one engine's vocabulary. Thread-safe: the sidecar compiles in worker
    threads while the engine thread compiles too (cache hits). The compiler keeps compiled grammars
    (an LRU bounded in bytes), so compiling a spec again costs some microseconds."""

    def __init__(self, info: xgr.TokenizerInfo, cache_limit_bytes: int = GRAMMAR_CACHE_BYTES):
        self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=cache_limit_bytes)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; raises ProtocolError("...", "structured") with
        xgrammar's message if the schema, regex, choice list or grammar is bad."""
        try:
            return _COMPILE[spec.kind](self._compiler, spec.spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar raises both, and subclasses of them
            message = grammar_error_message(exc)
            raise ProtocolError(f"invalid structured output ({spec.kind}): {message}", "structured") from None


def new_matcher(grammar: xgr.CompiledGrammar, stop_token_ids: Iterable[int]) -> xgr.GrammarMatcher:
    """A matcher of ``grammar`` for one sequence. Once the grammar is complete it admits
    ``stop_token_ids`` (none given: the vocabulary's) and terminates on accepting one."""
    stops = sorted(set(stop_token_ids))
    return xgr.GrammarMatcher(grammar, override_stop_tokens=stops or None)


class TokenMasks:
    """Fills the token bitmasks of a step's constrained rows on the CPU, in xgrammar's thread pool,
    and applies them to the logits in place with one kernel (on the logits' device). Keeps the
    host buffer between steps; not thread-safe."""

    def __init__(self) -> None:
        self._batch: xgr.BatchGrammarMatcher | None = None  # its thread pool, made on first use
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy of the buffer

    def apply(self, logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> None:
        """Set to -inf, in row ``i`` of ``logits`` ``[rows, vocab]``, every token ``matchers[i]``
        does not admit next; rows whose matcher is None are left alone."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        num_rows, vocab = logits.shape
        host = self._buffer(num_rows, vocab, pin=logits.is_cuda)
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        # Row i of the bitmask masks row i of the logits; rows not in ``rows`` are neither
        # filled nor read.
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], host, indices=rows)
        # Row indices for the kernel, None for all rows. On CUDA they travel from pinned memory: a copy
        # from pageable memory would wait for the step's forward to finish before the host goes on.
        indices: torch.Tensor | list[int] | None = None if len(rows) == num_rows else rows
        bitmask = host
        if logits.is_cuda:
            if indices is not None:
                indices = torch.tensor(rows, dtype=torch.int32).pin_memory().to(logits.device, non_blocking=True)
            bitmask = host.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)

    def _buffer(self, num_rows: int, vocab: int, pin: bool) -> torch.Tensor:
        if self._copied is not None:  # the copy in flight still reads the pinned buffer
            self._copied.synchronize()
            self._copied = None
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != xgr.get_bitmask_shape(1, vocab)[1]:
            host = self._host = xgr.allocate_token_bitmask(num_rows, vocab)
            if pin:
                host = self._host = host.pin_memory()
        return host[:num_rows]
