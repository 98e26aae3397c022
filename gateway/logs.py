"""structlog JSON logs on stderr; stdlib loggers (uvicorn, httpx) are rendered the same way.

``merge_contextvars`` puts the bound ``request_id`` into every line logged while a request runs.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO") -> None:
    # Tracebacks as JSON, without local variables: those can hold API keys and prompts.
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
    # httpx logs every engine call at INFO; that is per-request noise next to our own request line.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))
    structlog.configure(
        processors=[*shared, tracebacks, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
