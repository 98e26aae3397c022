"""Structured output and forced tool calls through the official openai SDK, against a real gateway and
engine (SmolLM2 on this machine's CPU, or CUDA if present): how many answers validate.

For each of the ten response models in ``benchmarks/structured_cases.py`` and each temperature (0 and
1.0), ``--per-case`` requests through ``client.chat.completions.parse(response_format=Model)``; then
``--tool-calls`` requests with ``tool_choice="required"`` and as many naming one function, whose calls
must name a given tool and whose arguments must validate against its model; then, at temperature 0,
the SDK's ``.stream()`` helper must reassemble the same tool calls as the plain request. One JSON line
per case, with the commit and date.

    python3 benchmarks/structured_validity.py [--per-case 10] [--tool-calls 50] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.structured_cases import MAX_TOKENS, SCHEMAS, TOOL_MODELS, TOOL_PROMPT, TOOLS
from gateway.spawn import free_port
from loadtest.stamp import emit

ROOT = Path(__file__).resolve().parents[1]


def start_gateway(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--spawn-engines", "1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the gateway exited: see {log}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("the gateway was not ready within 300 s")


async def parse_case(client: openai.AsyncOpenAI, gate: asyncio.Semaphore, name: str, temperature: float,
                     n: int) -> None:
    model, prompt = SCHEMAS[name]
    reasons: Counter[str] = Counter()
    valid = tokens = 0

    async def one(seed: int) -> None:
        nonlocal valid, tokens
        async with gate:
            try:
                done = await client.chat.completions.parse(
                    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
                    response_format=model, temperature=temperature, seed=seed, max_tokens=MAX_TOKENS)
            except (openai.LengthFinishReasonError, ValidationError) as exc:
                reasons[type(exc).__name__] += 1
                return
            choice = done.choices[0]
            reasons[choice.finish_reason] += 1
            tokens += done.usage.completion_tokens
            valid += isinstance(choice.message.parsed, model)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(seed) for seed in range(n)))
    emit(bench="structured_validity", case=name, temperature=temperature, requests=n, valid=valid,
         valid_fraction=round(valid / n, 4), finish=dict(reasons), mean_completion_tokens=round(tokens / n, 1),
         seconds=round(time.perf_counter() - t0, 1))


def check_calls(tool_calls, only: str | None) -> bool:
    if not tool_calls:
        return False
    for call in tool_calls:
        model = TOOL_MODELS.get(call.function.name)
        if model is None or (only is not None and call.function.name != only):
            return False
        try:
            model.model_validate_json(call.function.arguments)
        except ValidationError:
            return False
    return True


async def tool_case(client: openai.AsyncOpenAI, gate: asyncio.Semaphore, tool_choice, n: int) -> None:
    only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    valid = 0
    finish: Counter[str] = Counter()

    async def one(seed: int) -> None:
        nonlocal valid
        async with gate:
            done = await client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": TOOL_PROMPT}], tools=TOOLS,
                tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        choice = done.choices[0]
        finish[choice.finish_reason] += 1
        valid += check_calls(choice.message.tool_calls, only)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(seed) for seed in range(n)))
    emit(bench="tool_calls_validity", tool_choice=only or tool_choice, requests=n, valid=valid,
         valid_fraction=round(valid / n, 4), finish=dict(finish), seconds=round(time.perf_counter() - t0, 1))


async def stream_matches(client: openai.AsyncOpenAI, tool_choice) -> None:
    """The SDK's stream helper reassembles the same calls as the plain request (temperature 0)."""
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": TOOL_PROMPT}], tools=TOOLS,
                  tool_choice=tool_choice, temperature=0.0, max_tokens=MAX_TOKENS)
    plain = (await client.chat.completions.create(**kwargs)).choices[0].message.tool_calls or []
    async with client.chat.completions.stream(**kwargs) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    same = [(c.function.name, c.function.arguments) for c in plain] == [
        (c.function.name, c.function.arguments) for c in streamed]
    emit(bench="tool_calls_stream", tool_choice=tool_choice if isinstance(tool_choice, str) else
         tool_choice["function"]["name"], calls=len(plain), same_as_plain=same)


async def run(url: str, args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(args.concurrency)
    for temperature in (0.0, 1.0):
        for name in SCHEMAS:
            await parse_case(client, gate, name, temperature, args.per_case)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        await tool_case(client, gate, tool_choice, args.tool_calls)
        await stream_matches(client, tool_choice)
    await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-case", type=int, default=10, help="requests per schema and temperature (default: 10)")
    parser.add_argument("--tool-calls", type=int, default=50, help="requests per tool_choice (default: 50)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    parser.add_argument("--log", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "structured_gateway.log",
                        help="the gateway's log file")
    args = parser.parse_args()
    proc, url = start_gateway(args.log)
    try:
        asyncio.run(run(url, args))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
