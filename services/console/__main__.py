"""python -m baton_runtime.console: serve the console until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

import structlog
import uvicorn

from baton_runtime.common.config import ConfigError
from baton_runtime.common.observability.logs import configure_logging
from baton_runtime.console.app import create_app
from baton_runtime.console.config import ConsoleConfig, split_listen

log = structlog.get_logger("baton.console")


def main() -> None:
    try:
        config = ConsoleConfig.load()
        host, port = split_listen(config.listen)
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging(config.log_level)
    log.info("serving", url=f"http://{config.listen}/", remote=config.allow_remote)
    uvicorn.run(
        create_app(config),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        # The console's own answers carry no Server header; one proxy hop
        # is never trusted for the caller's address (the guard reads the peer).
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    main()
