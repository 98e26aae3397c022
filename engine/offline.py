"""``python -m engine generate``: JSONL requests on stdin, JSONL results on stdout, in input order."""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from engine.core import EngineCore
from engine.protocol import OutputFrame, ProtocolError, parse_generate_request

# The fields of a line that belong to the request; every other one is a sampling field.
REQUEST_FIELDS = ("prompt_ids", "salt", "cache_boundaries")


def _parse_line(core: EngineCore, line: str, index: int):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"line {index + 1} is not valid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"line {index + 1} must be a JSON object")
    wire = {"request_id": f"offline-{index}", "sampling": {k: v for k, v in obj.items() if k not in REQUEST_FIELDS}}
    wire.update((k, obj[k]) for k in REQUEST_FIELDS if k in obj)
    if "logit_bias" in wire["sampling"] and isinstance(wire["sampling"]["logit_bias"], dict):
        try:  # JSON object keys are strings
            wire["sampling"]["logit_bias"] = {int(k): v for k, v in wire["sampling"]["logit_bias"].items()}
        except ValueError:
            raise ProtocolError("logit_bias keys must be token ids", "logit_bias") from None
    request = parse_generate_request(wire, core.limits)
    core.check_admissible(request)
    return request


def _result(frames: list[OutputFrame], want_logprobs: bool) -> dict[str, Any]:
    token_ids = [t for f in frames for t in f.token_ids]
    out: dict[str, Any] = {
        "token_ids": token_ids,
        "finish_reason": frames[-1].finish_reason,
        "num_cached_tokens": frames[-1].num_cached_tokens,
    }
    if want_logprobs:
        out["logprobs"] = [
            {"logprob": lp.logprob, "top": [list(t) for t in lp.top]} for f in frames for lp in f.logprobs or []
        ]
    prompt = next((f.prompt_logprobs for f in frames if f.prompt_logprobs is not None), None)
    if prompt is not None:  # sequence 0's
        out["prompt_logprobs"] = [{"logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}
                                  for lp in prompt]
    return out


def run_offline(core: EngineCore, lines: list[str], out: IO[str] = sys.stdout) -> None:
    """Submit every valid line at once (so they batch), step until done, print in input order."""
    results: list[dict[str, Any] | None] = [None] * len(lines)
    pending: dict[str, tuple[int, int, bool]] = {}  # request id -> (line, n, wants logprobs)
    frames: dict[tuple[str, int], list[OutputFrame]] = {}
    for i, line in enumerate(lines):
        try:
            request = _parse_line(core, line, i)
            core.add_request(request)  # compiles a structured request's grammar: a bad one is an error line
        except ProtocolError as exc:
            results[i] = {"error": {"message": exc.message, "param": exc.param}}
            continue
        pending[request.request_id] = (i, request.sampling.n, request.sampling.logprobs is not None)
    while core.has_work():
        for frame in core.step():
            frames.setdefault((frame.request_id, frame.index), []).append(frame)
    for request_id, (i, n, want_logprobs) in pending.items():
        outputs = [_result(frames[(request_id, k)], want_logprobs) for k in range(n)]
        results[i] = outputs[0] if n == 1 else {
            "outputs": outputs, "num_cached_tokens": outputs[0]["num_cached_tokens"]
        }
    for result in results:
        out.write(json.dumps(result) + "\n")
    out.flush()
