#!/bin/sh
# baton-entrypoint: the container image's entrypoint (deploy/Dockerfile).
#
#   baton-entrypoint hooks|anchor|owner|ingress [FLAGS...]   run that service
#   baton-entrypoint baton [ARGS...]                          the `baton` CLI (e.g. demo)
#   baton-entrypoint etcdctl [ARGS...]                        etcdctl (the etcd auth Job)
#
# The service replaces this shell (exec), so it is PID 1 and receives
# SIGTERM itself: it reports NOT_SERVING, drains for BATON_SHUTDOWN_GRACE
# seconds and exits. Every flag also has an environment variable (see
# `baton-entrypoint <service> --help`); the manifests use the variables.
set -eu

python=${BATON_PYTHON:-python}

usage() {
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
}

if [ $# -eq 0 ]; then
    usage >&2
    exit 2
fi
command=$1
shift
case "$command" in
    hooks | anchor | owner | ingress)
        exec "$python" -m "baton_runtime.$command" "$@"
        ;;
    baton)
        exec "$python" -m baton_runtime.cli "$@"
        ;;
    etcdctl)
        exec etcdctl "$@"
        ;;
    -h | --help | help)
        usage
        ;;
    *)
        echo "baton-entrypoint: unknown command '$command'" >&2
        usage >&2
        exit 2
        ;;
esac
