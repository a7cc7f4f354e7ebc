"""Secrets read from files: the router<->worker shared token (--auth-token-file) and the clients' API keys
(--api-key-file). Never flags, never logged; compared in constant time; re-read on SIGHUP.

A file holds one secret per line (blank lines and lines starting with # are skipped). The router accepts
any of them, a worker sends the first: to rotate, list the new secret first and keep the old one below it
until every peer has the new one (SIGHUP each after editing its file), then drop the old line.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

from kvpact.shared.errors import ConfigError


def read_secrets(path: str, flag: str) -> tuple[str, ...]:
    """The secrets in `path`, in order. ConfigError (naming `flag`) when unreadable or empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{flag} {path}: not UTF-8 text") from exc
    values = tuple(
        line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")
    )
    if not values:
        raise ConfigError(f"{flag} {path} is empty (one secret per line)")
    return values


def read_token(path: str | None) -> str | None:
    """The token a worker sends: the first secret in `path`, or None when no file is given."""
    if not path:
        return None
    return read_secrets(path, "--auth-token-file")[0]


def matches_any(accepted: tuple[str, ...], given: str) -> bool:
    """Whether `given` is one of `accepted`; every one is compared, each in constant time."""
    found = False
    for secret in accepted:
        found |= hmac.compare_digest(secret.encode(), given.encode())
    return found


@dataclass(slots=True)
class SecretFile:
    """The secrets of one flag's file, held by the process that checks them. No file and no values: nothing
    is required. `reload()` re-reads the file (SIGHUP); a file that became unreadable or empty keeps the
    previous secrets and raises ConfigError, so a botched edit never locks everyone out."""

    flag: str
    path: str | None = None
    values: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def load(cls, flag: str, path: str | None) -> SecretFile:
        return cls(flag, path, read_secrets(path, flag) if path else ())

    @property
    def required(self) -> bool:
        return bool(self.values)

    @property
    def first(self) -> str:
        return self.values[0] if self.values else ""

    def matches(self, given: str) -> bool:
        return not self.values or matches_any(self.values, given)

    def reload(self) -> bool:
        """Re-read the file; True when there is one. ConfigError leaves the current secrets in force."""
        if not self.path:
            return False
        self.values = read_secrets(self.path, self.flag)
        return True
