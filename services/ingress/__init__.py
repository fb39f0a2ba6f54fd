"""ingress: the public edge for channel gateways."""
