"""One row per request: what the Locust users write and the report reads (no locust import here)."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(slots=True)
class RequestRecord:
    """One chat completion as the client saw it. Times in ms; token counts from the response's usage."""

    start: float  # Unix time the request was sent
    kind: str  # workload kind (agent | chat)
    user: int  # Locust user number, in spawn order
    conversation: int
    turn: int
    ok: bool = False
    status: int = 0  # HTTP status, 0 when no response came
    error: str = ""
    replica: str = ""  # the x-kvgate-replica response header, when the gateway sends it
    ttft_ms: float | None = None  # to the first chunk that carries generated tokens
    itl_ms: float | None = None  # mean gap between chunks with tokens (None below two such chunks)
    e2e_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    token_chunks: int = 0  # SSE chunks that carried generated tokens
    # A conversation's first request under --conversation-rate: how late it was sent against its arrival
    # time (its user was still in the previous conversation). None for every other request.
    start_lag_ms: float | None = None


FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))
_TYPES = {"start": float, "user": int, "conversation": int, "turn": int, "status": int, "e2e_ms": float,
          "prompt_tokens": int, "cached_tokens": int, "completion_tokens": int, "token_chunks": int}


class RecordWriter:
    """Appends records to a CSV file, flushing each row so an interrupted run keeps what it had."""

    def __init__(self, path: str | Path):
        self._file: IO[str] = Path(path).open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=FIELDS)
        self._writer.writeheader()

    def write(self, record: RequestRecord) -> None:
        self._writer.writerow(dataclasses.asdict(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _parse(row: dict[str, str]) -> RequestRecord:
    values: dict[str, object] = {}
    for name in FIELDS:
        text = row[name]
        if name == "ok":
            values[name] = text == "True"
        elif name in ("ttft_ms", "itl_ms", "start_lag_ms"):
            values[name] = float(text) if text else None
        elif name in _TYPES:
            values[name] = _TYPES[name](text)
        else:
            values[name] = text
    return RequestRecord(**values)


def read_records(path: str | Path) -> list[RequestRecord]:
    """All records of a CSV written by :class:`RecordWriter`; raises ValueError naming a bad row."""
    records = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not a request-records CSV (missing columns {sorted(missing)})")
        for number, row in enumerate(reader, 2):
            try:
                records.append(_parse(row))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path} line {number}: {exc}") from None
    return records


def iter_rows(records: list[RequestRecord], **extra: str) -> Iterator[dict[str, object]]:
    """Rows for a combined CSV: each record's fields after the ``extra`` columns."""
    for record in records:
        yield {**extra, **dataclasses.asdict(record)}
