"""JSON logs on stderr for both processes (stdout belongs to `engine generate`): structlog's own lines
and the stdlib loggers' (uvicorn, httpx) are rendered the same way, and written by one handler under
one lock (two writers on one stream, from two threads, interleave their lines).

Imports nothing but logging and structlog, so the gateway uses it too: one logging behaviour. The
bound ``request_id`` (``merge_contextvars``) is in every line logged while a gateway request runs.
"""

from __future__ import annotations

import logging
import sys

import structlog

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(level: str = "INFO") -> None:
    # Tracebacks as JSON, without local variables: those can hold API keys, prompts and salts.
    tracebacks = structlog.processors.ExceptionRenderer(
        structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            tracebacks,
            structlog.processors.JSONRenderer(),
        ],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every call at INFO: per-request noise next to the gateway's own request line.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
