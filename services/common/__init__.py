"""Shared infrastructure of every Baton service: config, logging, server
bootstrap, error mapping, ids and the etcd key schema."""
