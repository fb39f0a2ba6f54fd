"""`python -m webhook_gateway`: the gateway on uvicorn, configured from the
environment: the Baton client as the SDK reads it (`baton up`'s profile,
BATON_INGRESS_ADDR, BATON_TLS_CA, BATON_API_KEY), and GATEWAY_LISTEN
(default 127.0.0.1:8080), GATEWAY_BASE_URL (the links' base, default
http://GATEWAY_LISTEN), GATEWAY_SECRET (signs approval links; required),
GATEWAY_STATE (the state file, default gateway-state.json)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import uvicorn
from baton_client import AsyncClient

from webhook_gateway.app import create_app


def main() -> None:
    secret = os.environ.get("GATEWAY_SECRET", "")
    if not secret:
        sys.exit("webhook_gateway: set GATEWAY_SECRET (it signs the approval links)")
    host, _, port = os.environ.get("GATEWAY_LISTEN", "127.0.0.1:8080").rpartition(":")
    app = create_app(
        AsyncClient.from_profile,
        state_path=Path(os.environ.get("GATEWAY_STATE", "gateway-state.json")).resolve(),
        secret=secret.encode(),
        base_url=os.environ.get("GATEWAY_BASE_URL", f"http://{host}:{port}"),
    )
    uvicorn.run(app, host=host, port=int(port))


if __name__ == "__main__":
    main()
