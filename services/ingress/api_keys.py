"""Channel API keys: read from a file, held as hashes, reloaded on SIGHUP.

The file (`--api-keys-file`, env `BATON_API_KEYS_FILE`; e.g. a mounted
Kubernetes secret) has one `channel=credential` per line, `#` comments:

    slack=sha256:3f0a...          # the SHA-256 of the key, hex (preferred)
    web=Zq4v9...                  # or the key itself, hashed when read

Only SHA-256 digests are kept in memory; a key given in clear must be
strong (`check_strength`). A presented key is hashed and looked up, so the
comparison is over digests (no timing leak about the key). Keys never come
from argv or the environment, and are never logged: a malformed line is
reported by its line number only.

`ApiKeys.reload()` re-reads the file: the new set replaces the old one at
once (a removed key stops working for the next call), and a file that does
not parse leaves the old set in place. Ingress calls it on SIGHUP, and
`watch` calls it when the file changes (a Kubernetes secret volume is
updated in place, and nothing sends SIGHUP then).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import re
import string
import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from baton_runtime.common.config import ConfigError
from baton_runtime.common.errors import BatonError
from baton_runtime.common.ids import validate_channel

log = structlog.get_logger("baton.ingress.keys")

MIN_KEY_CHARS = 20
MIN_KEY_BITS = 80
MIN_DISTINCT_CHARS = 8
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def hash_line(channel: str, key: str) -> str:
    """The file line that grants `key` to `channel` without storing it."""
    check_strength(key)
    return f"{channel}=sha256:{digest(key).hex()}"


def estimated_bits(key: str) -> float:
    """A rough strength estimate: length times log2 of the alphabet the key
    draws from (lower, upper, digits, others). Random keys meet it easily;
    short or one-character-class keys do not."""
    pool = 0
    if any(c in string.ascii_lowercase for c in key):
        pool += 26
    if any(c in string.ascii_uppercase for c in key):
        pool += 26
    if any(c in string.digits for c in key):
        pool += 10
    if any(not c.isalnum() for c in key):
        pool += 32
    return len(key) * math.log2(pool) if pool else 0.0


def check_strength(key: str) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"an API key must have at least {MIN_KEY_CHARS} characters")
    if len(set(key)) < MIN_DISTINCT_CHARS or estimated_bits(key) < MIN_KEY_BITS:
        raise ConfigError(
            f"an API key must be random: at least {MIN_DISTINCT_CHARS} distinct characters "
            f"and about {MIN_KEY_BITS} bits (e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(24))'`)"
        )
    if any(c.isspace() or ord(c) < 0x21 or ord(c) > 0x7E for c in key):
        raise ConfigError("an API key must be printable ASCII without spaces")


def parse_key_lines(text: str, source: str = "the API key file") -> dict[bytes, str]:
    """`channel=credential` lines -> {sha256 digest: channel}."""
    keys: dict[bytes, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        channel, sep, credential = line.partition("=")
        channel, credential = channel.strip(), credential.strip()
        where = f"{source}, line {number}"
        if not sep or not credential:
            raise ConfigError(f"{where}: expected channel=sha256:<hex> or channel=<key>")
        try:
            validate_channel(channel)
        except BatonError as exc:
            raise ConfigError(f"{where}: {exc.message}") from exc
        match = _DIGEST_RE.match(credential)
        if match:
            value = bytes.fromhex(match.group(1))
        else:
            try:
                check_strength(credential)
            except ConfigError as exc:
                raise ConfigError(f"{where} (channel {channel}): {exc}") from exc
            value = digest(credential)
        if value in keys:
            raise ConfigError(f"{where}: the same key is already granted to a channel")
        keys[value] = channel
    if not keys:
        raise ConfigError(f"{source} grants no API key")
    return keys


def read_key_file(path: str) -> dict[bytes, str]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read API key file {path}: {exc.strerror}") from exc
    return parse_key_lines(text, path)


class ApiKeys:
    """The current key digests -> channel, from a file (or a fixed mapping)."""

    def __init__(self, path: str = "", keys: Mapping[bytes, str] | None = None) -> None:
        if not path and keys is None:
            raise ConfigError("an API key file is required")
        self.path = path
        self._stamp = self._file_stamp()
        self._keys: dict[bytes, str] = dict(keys) if keys is not None else read_key_file(path)
        self._lock = threading.Lock()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        """What changes when the file is replaced or rewritten (following
        symlinks, as a secret volume's are)."""
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    @classmethod
    def of(cls, keys: Mapping[str, str]) -> ApiKeys:
        """From {key: channel} in memory (tests and tools), hashed at once."""
        return cls(keys={digest(key): channel for key, channel in keys.items()})

    def channel_of(self, key: str) -> str | None:
        return self._keys.get(digest(key))

    @property
    def channels(self) -> set[str]:
        return set(self._keys.values())

    def reload(self) -> bool:
        """Re-read the file; True when it was read (then it replaced the
        old set). A bad file keeps the old set and is logged, keys never."""
        if not self.path:
            return False
        self._stamp = self._file_stamp()
        try:
            keys = read_key_file(self.path)
        except ConfigError as exc:
            log.error("API key file not reloaded; keeping the previous keys", error=str(exc))
            return False
        with self._lock:
            self._keys = keys
        log.info("API keys reloaded", channels=sorted(set(keys.values())), keys=len(keys))
        return True

    def reload_if_changed(self) -> bool:
        """Reload when the file changed since it was last read."""
        if self.path and self._file_stamp() != self._stamp:
            return self.reload()
        return False

    async def watch(self, every: float) -> None:
        """Check the file for a change every `every` seconds, for ever."""
        while True:
            await asyncio.sleep(every)
            self.reload_if_changed()
