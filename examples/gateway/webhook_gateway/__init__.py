"""An example HTTP webhook gateway for Baton (README.md beside this package)."""

from webhook_gateway.app import create_app

__all__ = ["create_app"]
