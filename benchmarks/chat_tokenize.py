"""Gateway tokenizing of agent conversations: the time to turn each request's messages into prompt
token ids (chat template, tokens, cache boundaries), turn by turn.

The requests are the routing A/B's agent conversations (``loadtest.workload``, same seed and sizes),
sent turn by turn across ``--conversations`` conversations at once, as a gateway sees them. Measured
three ways in the same run: ours (``Tokenizer.chat_prompt``, which tokenizes only what follows a
cached conversation), ours with no conversation cache (the whole prompt, once), and the peer,
transformers' ``apply_chat_template(tokenize=True)`` (no boundaries). Every prompt's ids are checked
against the peer's. One JSON line per turn and way, then the totals.

    .venv/bin/python benchmarks/chat_tokenize.py [--conversations 16] [--turns 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.protocol import default_model_path  # noqa: E402
from gateway.tokenizer import Tokenizer, load_hf_tokenizer  # noqa: E402
from loadtest import stamp  # noqa: E402
from loadtest.workload import Workload, WorkloadConfig  # noqa: E402

CACHE_DIR = Path.home() / ".cache" / "kvgate"


def emit(**fields) -> None:
    stamp.emit(benchmark="chat_tokenize", **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16, help="conversations in flight (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    args = parser.parse_args()
    hf = load_hf_tokenizer(str(default_model_path()), CACHE_DIR)
    workload = Workload(WorkloadConfig(seed=args.seed, turns=args.turns))
    conversations = [workload.agent(i) for i in range(args.conversations)]
    ours, whole = Tokenizer(hf), Tokenizer(hf, cache_bytes=0)

    def peer(messages: list[dict]) -> list[int]:
        return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))

    ways: dict[str, Callable[[list[dict]], list[int]]] = {
        "ours": lambda m: ours.chat_prompt(m).token_ids,
        "ours_without_conversation_cache": lambda m: whole.chat_prompt(m).token_ids,
        "peer_transformers_apply_chat_template": peer,
    }
    totals = dict.fromkeys(ways, 0.0)
    for turn in range(args.turns):
        seconds = {name: [] for name in ways}
        lengths = []
        for conversation in conversations:
            messages = conversation.messages(turn)
            results = {}
            for name, tokenize in ways.items():
                start = time.perf_counter()
                results[name] = tokenize(messages)
                seconds[name].append(time.perf_counter() - start)
            reference = results["peer_transformers_apply_chat_template"]
            if any(ids != reference for ids in results.values()):
                raise SystemExit(f"conversation {conversation.index} turn {turn}: the ids differ from the peer's")
            lengths.append(len(reference))
        for name, values in seconds.items():
            totals[name] += sum(values)
            emit(way=name, turn=turn, requests=len(values), mean_prompt_tokens=round(statistics.mean(lengths)),
                 mean_ms=round(statistics.mean(values) * 1e3, 3), max_ms=round(max(values) * 1e3, 3))
    for name, total in totals.items():
        emit(way=name, turn="all", requests=args.turns * args.conversations,
             total_s=round(total, 3), speedup_vs_peer=round(totals["peer_transformers_apply_chat_template"] / total, 2))


if __name__ == "__main__":
    main()
