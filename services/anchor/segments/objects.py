"""The object store anchor seals logs into: one small adapter over obstore
(S3 and S3-compatible stores, GCS, Azure, the local filesystem; async).

`open_store(url)` builds the store from `--object-store` (env
`BATON_OBJECT_STORE`). Credentials and endpoints come from the library's
standard environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `GOOGLE_SERVICE_ACCOUNT`,
`AZURE_STORAGE_ACCOUNT_KEY`, ...), never from the URL: a URL carrying a user
or a password is refused, so the URL can be logged as it is.

Every call is bounded (connect 2 s, a request 10 s, two retries inside 5 s)
so an unreachable store fails fast: a caller gets `Unavailable`
(OBJECT_STORE_UNAVAILABLE, retryable) or, for an object that is not there,
`ObjectMissing`, and decides what that means.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import obstore
from obstore.store import from_url

from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import Reason, Unavailable
from baton_runtime.common.observability import metrics

SCHEMES = frozenset({"file", "memory", "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl"})
_ENV_PREFIX = {"gs": "GOOGLE", "az": "AZURE", "azure": "AZURE", "abfs": "AZURE", "abfss": "AZURE"}
_CLIENT_OPTIONS = {"connect_timeout": timedelta(seconds=2), "timeout": timedelta(seconds=10)}
_RETRY = {
    "max_retries": 2,
    "retry_timeout": timedelta(seconds=5),
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=1)},
}


class ObjectMissing(Exception):
    """The object is not in the store."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True)
class ListedObject:
    path: str
    size: int
    # Unix seconds (the store's clock).
    modified: float


def check_url(url: str) -> str:
    """`url` if anchor can open it; ConfigError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"object store URL {url!r}: the scheme must be one of {', '.join(sorted(SCHEMES))}"
        )
    if parts.username or parts.password:
        raise ConfigError(
            "object store URL: no credentials in the URL (they would show in argv and logs); "
            "set the store's environment variables (AWS_ACCESS_KEY_ID, ...) instead"
        )
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path):
        raise ConfigError(
            f"object store URL {url!r}: a file:// URL needs an absolute path (file:///dir)"
        )
    return url


class ObjectStore:
    """put/get/delete/list of whole objects under one store's prefix."""

    def __init__(self, store: Any, url: str) -> None:
        self._store = store
        self.url = url

    async def put(self, path: str, data: bytes) -> None:
        await self._call("put", obstore.put_async(self._store, path, data))

    async def get(self, path: str) -> bytes:
        async def fetch() -> bytes:
            result = await obstore.get_async(self._store, path)
            return bytes(await result.bytes_async())

        try:
            data: bytes = await self._call("get", fetch())
        except FileNotFoundError:
            raise ObjectMissing(path) from None
        return data

    async def delete(self, paths: Sequence[str]) -> None:
        """Delete `paths`; one already gone is no error."""
        if not paths:
            return
        try:
            await self._call("delete", obstore.delete_async(self._store, list(paths)))
        except FileNotFoundError:
            # (A local store refuses a batch naming a missing file: one by one.)
            for path in paths:
                try:
                    await self._call("delete", obstore.delete_async(self._store, path))
                except FileNotFoundError:
                    pass

    async def list(self, prefix: str) -> AsyncIterator[list[ListedObject]]:
        """The objects under `prefix`, in chunks (in key order on S3-like
        stores; the caller must not rely on it for a local one)."""
        started = time.perf_counter()
        try:
            async for chunk in obstore.list(self._store, prefix=prefix, chunk_size=1000):
                yield [_listed(meta) for meta in chunk]
        except FileNotFoundError:
            return
        except (obstore.exceptions.BaseError, OSError) as exc:
            metrics.OBJECT_STORE_ERRORS.labels("list").inc()
            raise _unavailable("list", exc) from exc
        finally:
            metrics.OBJECT_STORE_SECONDS.labels("list").observe(time.perf_counter() - started)

    async def _call(self, op: str, call: Any) -> Any:
        started = time.perf_counter()
        try:
            return await call
        except FileNotFoundError:
            raise
        except (obstore.exceptions.BaseError, OSError, RuntimeError) as exc:
            metrics.OBJECT_STORE_ERRORS.labels(op).inc()
            raise _unavailable(op, exc) from exc
        finally:
            metrics.OBJECT_STORE_SECONDS.labels(op).observe(time.perf_counter() - started)


def _unavailable(op: str, exc: BaseException) -> Unavailable:
    # The library's message can be long (a debug dump): its first line.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return Unavailable(
        Reason.OBJECT_STORE_UNAVAILABLE,
        f"object store {op} failed: {first[:300]}",
        retry_after=1.0,
    )


def _listed(meta: Any) -> ListedObject:
    modified = meta["last_modified"]
    stamp = modified.timestamp() if isinstance(modified, datetime) else float(modified)
    return ListedObject(str(meta["path"]), int(meta["size"]), stamp)


def open_store(url: str) -> ObjectStore:
    """The store `url` names (checked with `check_url`); a file:// directory
    is created if missing."""
    check_url(url)
    scheme = urlsplit(url).scheme
    if scheme == "file":
        Path(urlsplit(url).path).mkdir(parents=True, exist_ok=True)
        return ObjectStore(from_url(url), url)
    if scheme == "memory":
        return ObjectStore(from_url(url), url)
    options: dict[str, Any] = dict(_CLIENT_OPTIONS)
    # (Client options given here replace those the library reads from the
    # environment: carry its "plain HTTP allowed", for a local endpoint.)
    allow_http = os.environ.get(f"{_ENV_PREFIX.get(scheme, 'AWS')}_ALLOW_HTTP", "")
    if allow_http.strip().lower() in ("1", "true", "yes"):
        options["allow_http"] = True
    store = from_url(url, client_options=options, retry_config=_RETRY)  # type: ignore[call-overload]
    return ObjectStore(store, url)
