"""The `baton` command: run the whole system locally, and a demo client."""
