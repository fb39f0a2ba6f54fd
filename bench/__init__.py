"""Benchmarks of a real Baton stack (services as processes on a real etcd)."""
