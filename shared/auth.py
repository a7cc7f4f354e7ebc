"""The shared secret between router and workers (--auth-token-file). Never logged."""

from __future__ import annotations

import hmac
from pathlib import Path

from kvpact.shared.errors import ConfigError


def read_token(path: str | None) -> str | None:
    """The token in `path` (surrounding whitespace stripped), or None when no file is given."""
    if not path:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"--auth-token-file {path}: cannot read it ({exc.strerror})") from exc
    if not token:
        raise ConfigError(f"--auth-token-file {path} is empty")
    return token


def token_matches(expected: str | None, given: str) -> bool:
    """True when no token is required, or `given` equals it (constant-time comparison)."""
    if expected is None:
        return True
    return hmac.compare_digest(expected.encode(), given.encode())
