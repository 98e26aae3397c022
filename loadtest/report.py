"""The A/B report: per-policy summary, the single-cache ideal hit rate, CSV, JSON and PNG plots.

    python -m loadtest.report DIR

reads what ``python -m loadtest.ab`` left in DIR (``run.json`` and ``<policy>/requests.csv``,
``<policy>/replicas.json``) and (re)writes ``DIR/summary.json``, ``DIR/requests.csv`` and the plots
``ttft.png``, ``hit_rate.png``, ``throughput.png``.

The single-cache ideal: the successful requests of a policy, in the order they were sent, served by
one cache of unlimited size that keeps every full block of every prompt. A request's ideal cached
tokens are its longest run of leading full blocks already seen, leaving at least one prompt token
to compute — the engine's own rule (``KVCacheManager.match_prefix``). Prompts are rebuilt from the
seeded workload and tokenized with the gateway's tokenizer and chat template, so the ideal counts
the same tokens as the gateway's ``usage``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import structlog

from loadtest.records import FIELDS, RequestRecord, iter_rows, read_records
from loadtest.stamp import stamp
from loadtest.workload import Workload, WorkloadConfig
from prefix_index.hashing import BlockHash, block_hashes

BASELINE = "round-robin"
# A conversation sent this much after its arrival time counts as late: its user was busy, so the open
# loop of --conversation-rate held back that much load (a few late starts are fine; many mean too few users).
LATE_START_MS = 1000.0


class CacheTotals(NamedTuple):
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def single_cache_hits(prompts: Iterable[Sequence[int]], block_size: int) -> list[int]:
    """Cached tokens of each prompt, in order, if one unlimited cache had served them all."""
    seen: set[BlockHash] = set()
    hits = []
    for token_ids in prompts:
        hashes = block_hashes(token_ids, block_size)
        max_blocks = (len(token_ids) - 1) // block_size  # at least one token is computed
        matched = 0
        for block_hash in hashes[:max_blocks]:
            if block_hash not in seen:
                break
            matched += 1
        hits.append(matched * block_size)
        seen.update(hashes)
    return hits


def single_cache_ideal(prompts: Sequence[Sequence[int]], block_size: int) -> CacheTotals:
    return CacheTotals(sum(map(len, prompts)), sum(single_cache_hits(prompts, block_size)))


def sent_order(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """Successful records in the order they were sent."""
    return sorted((r for r in records if r.ok), key=lambda r: r.start)


def _percentiles(values: Sequence[float], points: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in points}
    array = np.asarray(values, dtype=float)
    return {f"p{p}": round(float(np.percentile(array, p)), 2) for p in points}


def summarize(records: Sequence[RequestRecord], ideal: CacheTotals) -> dict[str, Any]:
    """One policy's numbers. ``ideal`` is :func:`single_cache_ideal` over ``sent_order(records)``."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    hit_rate = cached / prompt if prompt else 0.0
    if ok:
        window_s = max(r.start + r.e2e_ms / 1e3 for r in ok) - min(r.start for r in records)
    else:
        window_s = 0.0
    lags = [r.start_lag_ms for r in records if r.start_lag_ms is not None]
    return {
        "requests": len(records),
        "failures": len(failed),
        "failure_examples": sorted({r.error for r in failed})[:5],
        "ttft_ms": _percentiles([r.ttft_ms for r in ok], (50, 90, 99)),
        "itl_ms": _percentiles([r.itl_ms for r in ok if r.itl_ms is not None], (50, 90)),
        "e2e_ms": _percentiles([r.e2e_ms for r in ok], (50, 90)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "hit_rate": round(hit_rate, 4),
        "ideal_prompt_tokens": ideal.prompt_tokens,
        "ideal_cached_tokens": ideal.cached_tokens,
        "ideal_hit_rate": round(ideal.hit_rate, 4),
        "hit_rate_of_ideal": round(hit_rate / ideal.hit_rate, 4) if ideal.hit_rate else None,
        "window_s": round(window_s, 2),
        "requests_per_s": round(len(ok) / window_s, 3) if window_s > 0 else 0.0,
        "output_tokens_per_s": round(completion / window_s, 2) if window_s > 0 else 0.0,
        "scheduled_starts": len(lags),
        "late_starts": sum(lag > LATE_START_MS for lag in lags),
        "start_lag_ms": _percentiles(lags, (50, 90, 99)),
    }


def compare(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each policy against round-robin: how many times lower its TTFT p50/p90 is (> 1 is better)."""
    base = policies.get(BASELINE)
    if base is None:
        return {}
    out = {}
    for name, s in policies.items():
        if name == BASELINE:
            continue
        ratios = {}
        for p in ("p50", "p90"):
            mine, theirs = s["ttft_ms"][p], base["ttft_ms"][p]
            ratios[f"ttft_{p}_speedup"] = round(theirs / mine, 2) if mine and theirs else None
        out[name] = ratios
    return {f"vs_{BASELINE}": out}


def policy_summary(records: Sequence[RequestRecord], prompt_ids: Callable[[RequestRecord], list[int]],
                   block_size: int) -> dict[str, Any]:
    prompts = [prompt_ids(r) for r in sent_order(records)]
    return summarize(records, single_cache_ideal(prompts, block_size))


def chat_prompt_ids(workload: Workload, tokenizer: Any) -> Callable[[RequestRecord], list[int]]:
    """A record's prompt token ids, rebuilt from the workload and tokenized as the gateway does."""

    def prompt_ids(record: RequestRecord) -> list[int]:
        messages = workload.conversation(record.kind, record.conversation).messages(record.turn)
        return tokenizer.chat_prompt(messages).token_ids

    return prompt_ids


def load_tokenizer(path: str) -> Any:
    """The gateway's tokenizer (imported here only: it pulls in transformers)."""
    from gateway.tokenizer import Tokenizer, load_hf_tokenizer

    cache_dir = Path(os.environ.get("KVGATE_CACHE_DIR", "~/.cache/kvgate")).expanduser()
    return Tokenizer(load_hf_tokenizer(path, cache_dir))


# --- plots ---


def _bars(ax: Any, names: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, fmt: str) -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(names))]
        bars = ax.bar(xs, [0 if v is None else v for v in values], width, label=label)
        ax.bar_label(bars, labels=["n/a" if v is None else fmt.format(v) for v in values], fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    if len(series) > 1:
        ax.legend()


def write_plots(policies: dict[str, dict[str, Any]], records: dict[str, list[RequestRecord]], out: Path,
                title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = list(policies)
    paths = []

    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
    _bars(bars, names, {p: [policies[n]["ttft_ms"][p] for n in names] for p in ("p50", "p90")}, "TTFT (ms)", "{:.0f}")
    bars.set_title("TTFT by routing policy")
    for name in names:
        ttfts = sorted(r.ttft_ms for r in records[name] if r.ok)
        if ttfts:
            cdf.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT distribution")
    cdf.grid(alpha=0.3)
    cdf.legend()
    paths.append(_save(fig, out / "ttft.png", title))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _bars(ax, names, {"measured": [policies[n]["hit_rate"] * 100 for n in names],
                      "single-cache ideal": [policies[n]["ideal_hit_rate"] * 100 for n in names]},
          "prompt tokens served from cache (%)", "{:.1f}")
    ax.set_ylim(0, 105)
    ax.set_title("Prefix-cache hit rate")
    paths.append(_save(fig, out / "hit_rate.png", title))

    fig, (tokens, reqs) = plt.subplots(1, 2, figsize=(10, 4.2))
    _bars(tokens, names, {"output": [policies[n]["output_tokens_per_s"] for n in names]}, "tokens/s", "{:.1f}")
    tokens.set_title("Output throughput")
    _bars(reqs, names, {"requests": [policies[n]["requests_per_s"] for n in names]}, "requests/s", "{:.2f}")
    reqs.set_title("Completed requests")
    paths.append(_save(fig, out / "throughput.png", title))
    return paths


def _save(fig: Any, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the report of one A/B run directory ---


def write_report(out: Path, tokenizer: Any | None = None) -> dict[str, Any]:
    """Summarize every policy of the run in ``out``; writes summary.json, requests.csv and the plots."""
    run = json.loads((out / "run.json").read_text())
    workload = Workload(WorkloadConfig.from_json(run["workload"]))
    tokenizer = tokenizer or load_tokenizer(run["tokenizer"])
    prompt_ids = chat_prompt_ids(workload, tokenizer)
    records: dict[str, list[RequestRecord]] = {}
    policies: dict[str, dict[str, Any]] = {}
    for name in run["policies"]:
        path = out / name / "requests.csv"
        if not path.is_file():
            continue  # the run stopped before this policy
        records[name] = read_records(path)
        policies[name] = policy_summary(records[name], prompt_ids, run["block_size"])
        replicas = out / name / "replicas.json"
        if replicas.is_file():
            policies[name]["replicas"] = json.loads(replicas.read_text())
        cpu = out / name / "cpu.json"
        if cpu.is_file():
            policies[name]["cpu"] = cpu_summary(json.loads(cpu.read_text()), policies[name]["requests"])
    summary = {"run": run, "report": stamp(), "policies": policies, "comparison": compare(policies)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=("policy", *FIELDS))
        writer.writeheader()
        for name, rows in records.items():
            writer.writerows(iter_rows(rows, policy=name))
    if policies:
        rate = run.get("conversation_rate_per_s")
        arrivals = f" ({rate} conversations/s)" if rate else ""
        title = (f"{run['engines']} engines ({run['model']}), {run['users']} users{arrivals}, {run['duration_s']} s "
                 f"per policy, block {run['block_size']}, workload seed {run['workload']['seed']}")
        write_plots(policies, records, out, title)
    return summary


def cpu_summary(cpu: dict[str, Any], requests: int) -> dict[str, Any]:
    """``cpu.json`` of a policy, with the engines' CPU seconds per request and the share of the
    machine's cores that the whole run kept busy."""
    total = cpu["engines_s"] + cpu["gateways_s"] + cpu["locust_s"]
    return {**cpu, "engine_s_per_request": round(cpu["engines_s"] / requests, 3) if requests else None,
            "busy_fraction": round(total / (cpu["wall_s"] * cpu["cores"]), 3) if cpu["wall_s"] else None}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of the headline numbers, one policy per line."""
    lines = [f"{'policy':<12} {'reqs':>5} {'fail':>4} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} "
             f"{'hit':>6} {'ideal':>6} {'of ideal':>8} {'tok/s':>7} {'late':>5} {'engine s/req':>12}"]
    for name, s in summary["policies"].items():
        t = s["ttft_ms"]
        of_ideal = "-" if s["hit_rate_of_ideal"] is None else f"{s['hit_rate_of_ideal']:.0%}"
        lines.append(f"{name:<12} {s['requests']:>5} {s['failures']:>4} {_ms(t['p50']):>9} {_ms(t['p90']):>8} "
                     f"{_ms(t['p99']):>8} {_ms(s['itl_ms']['p50']):>8} {s['hit_rate']:>6.1%} "
                     f"{s['ideal_hit_rate']:>6.1%} {of_ideal:>8} {s['output_tokens_per_s']:>7.1f} "
                     f"{s['late_starts']:>5} {_seconds(s.get('cpu', {}).get('engine_s_per_request')):>12}")
    return "\n".join(lines)


def quiet_logs() -> None:
    """The gateway tokenizer logs a line per prompt at DEBUG: keep a report's output to warnings."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the --out directory of a loadtest.ab run")
    args = parser.parse_args(argv)
    if not (args.out / "run.json").is_file():
        print(f"error: {args.out} has no run.json (not a loadtest.ab output directory)", file=sys.stderr)
        return 2
    quiet_logs()
    print(format_table(write_report(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
