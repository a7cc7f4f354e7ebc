"""shared/auth.py (secret files: parsing, constant-time matching, reload) and shared/tls.py's pure helpers."""

from __future__ import annotations

import pytest

from kvpact.shared.auth import SecretFile, matches_any, read_secrets, read_token
from kvpact.shared.errors import ConfigError
from kvpact.shared.tls import handshake_failure, is_loopback, plaintext_warning

FAILED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:44595: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
    "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK"
)


def test_a_secret_file_holds_one_secret_per_line_skipping_blanks_and_comments(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# new key first\n  new-key  \n\nold-key\n")
    assert read_secrets(str(path), "--api-key-file") == ("new-key", "old-key")
    assert read_token(str(path)) == "new-key"  # what a worker sends
    path.write_text("# nothing but a comment\n\n")
    with pytest.raises(ConfigError, match=r"--api-key-file .* is empty \(one secret per line\)"):
        read_secrets(str(path), "--api-key-file")
    with pytest.raises(ConfigError, match="--auth-token-file .*absent: cannot read it"):
        read_token(str(tmp_path / "absent"))


def test_matching_accepts_any_listed_secret_and_nothing_else():
    assert matches_any(("a1", "b2"), "b2") and matches_any(("a1", "b2"), "a1")
    assert not matches_any(("a1", "b2"), "a") and not matches_any(("a1",), "") and not matches_any((), "a1")
    assert SecretFile("--api-key-file").matches("anything")  # no file: nothing required


def test_reload_swaps_the_secrets_and_a_botched_file_keeps_the_old_ones(tmp_path):
    path = tmp_path / "keys"
    path.write_text("one\n")
    secrets = SecretFile.load("--api-key-file", str(path))
    assert secrets.matches("one") and not secrets.matches("two") and "one" not in repr(secrets)
    path.write_text("two\n")
    assert secrets.reload() and secrets.matches("two") and not secrets.matches("one")
    path.write_text("\n")
    with pytest.raises(ConfigError):
        secrets.reload()
    assert secrets.matches("two")
    assert not SecretFile(
        "--api-key-file", None, ("x",)
    ).reload()  # values given directly: nothing to re-read


def test_a_tls_handshake_failure_is_told_apart_from_other_failures():
    assert handshake_failure(FAILED) == (
        "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
        "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate"
    )
    assert handshake_failure("failed to connect to all addresses; last error: Connection refused") is None
    assert handshake_failure(None) is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("router.internal", False)],
)  # fmt: skip
def test_plaintext_off_loopback_warns_naming_the_flags(host, loopback):
    warning = plaintext_warning(host, None)
    assert is_loopback(host) is loopback
    assert (warning is None) is loopback
    if warning:
        assert "--tls-cert and --tls-key" in warning and host in warning
