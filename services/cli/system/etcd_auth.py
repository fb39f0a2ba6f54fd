"""Turn on etcd's user/role auth for Baton, as an operator would.

With `--client-cert-auth`, etcd takes a client certificate's common name as
the user name. This creates (idempotently, over TLS, as the `root` user):

- role `baton` with read-write permission on Baton's key prefix only;
- a password-less user per service certificate CN (`hooks`, `anchor`) with
  that role;
- user `root` (password-less: it authenticates by its certificate) with the
  root role, which etcd requires before auth can be enabled;

then enables auth. The same steps with etcdctl are in docs/security.md. Used
by `baton up` and the test stack.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from aetcd import rpc

from baton_runtime.common.etcd.keys import prefix_end
from baton_runtime.common.security.tls import TlsFiles, channel_credentials, load_material

ROLE = "baton"
ROOT = "root"


def _ignore_exists(call: object) -> None:
    try:
        call()  # type: ignore[operator]  # a stub method bound in a lambda
    except grpc.RpcError as exc:
        details = exc.details() if hasattr(exc, "details") else ""
        if "already exists" not in (details or "") and "already granted" not in (details or ""):
            raise


def enable_auth(
    endpoint: str, root: TlsFiles, users: Iterable[str], prefix: str, timeout: float = 10.0
) -> None:
    """Give `users` read-write access to `prefix` (only) and enable auth.
    Safe to repeat on an etcd where it already ran."""
    credentials = channel_credentials(load_material(root))
    with grpc.secure_channel(endpoint, credentials) as channel:
        auth = rpc.AuthStub(channel)
        key = prefix.encode()
        _ignore_exists(lambda: auth.RoleAdd(rpc.AuthRoleAddRequest(name=ROLE), timeout=timeout))
        auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(
                name=ROLE,
                perm=rpc.Permission(
                    permType=rpc.Permission.READWRITE, key=key, range_end=prefix_end(key)
                ),
            ),
            timeout=timeout,
        )
        no_password = rpc.UserAddOptions(no_password=True)
        for user in (*users, ROOT):
            _ignore_exists(
                lambda user=user: auth.UserAdd(
                    rpc.AuthUserAddRequest(name=user, options=no_password), timeout=timeout
                )
            )
            role = "root" if user == ROOT else ROLE
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=role), timeout=timeout)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout)
