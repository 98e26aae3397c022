"""python -m gateway serve: the OpenAI-compatible gateway (see --help)."""

from __future__ import annotations

import sys

import structlog

from gateway.config import build_parser, config_from_args
from gateway.settings import ConfigError

GRACEFUL_SHUTDOWN_SECONDS = 30


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from engine.logs import configure_logging
    from gateway.app import create_app
    from gateway.http_limits import limited_protocol

    configure_logging(config.log_level)
    structlog.get_logger("gateway").info("gateway_starting", **config.summary())
    uvicorn.run(
        create_app(config), host=config.host, port=config.port, root_path=config.root_path,
        log_config=None, access_log=False, proxy_headers=False, lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        http=limited_protocol(config.http), timeout_keep_alive=config.http.keep_alive_timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
