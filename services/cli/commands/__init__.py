"""The baton command's subcommands: sessions, deployments, operator views, keys, etcd, profile, up
and the demo.
"""
