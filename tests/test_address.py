"""shared.address.join_host_port: the one HOST:PORT writer, and its round trip through cli.host_port."""

import pytest

from kvpact.shared.address import join_host_port
from kvpact.shared.cli import host_port


@pytest.mark.parametrize(
    ("host", "port", "text"),
    [
        ("127.0.0.1", 50051, "127.0.0.1:50051"),
        ("localhost", 0, "localhost:0"),
        ("::1", 50051, "[::1]:50051"),
        ("[::1]", 50051, "[::1]:50051"),
        ("fe80::1%eth0", 8000, "[fe80::1%eth0]:8000"),
    ],
)
def test_join_host_port_brackets_ipv6_once(host, port, text):
    assert join_host_port(host, port) == text
    assert host_port(text) == (host.strip("[]"), port)
