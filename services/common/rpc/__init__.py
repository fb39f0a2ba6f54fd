"""gRPC serving: a service's process (main), one server assembly (server), one interceptor
(identity, roles, admission), and the one table between domain errors and gRPC statuses
(status_map).
"""
