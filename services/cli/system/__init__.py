"""A local Baton system: etcd (binary choice, checks, auth, process), the services' processes
(settings, environment, ports, supervision, the orphan guard) and the launcher that starts them.
"""
