"""The web console (`python -m baton_runtime.console`, docs/console.md):
sessions, deployments and handoffs in a browser, read and acted on as an
operator over the services' TLS identities."""
