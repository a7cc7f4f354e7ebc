"""An alias kept only until deploy/launch.py imports `kvpact.client.transport` (the transport lives in
shared/client/transport.py, docs/design.md "Where each concept lives"); then delete this file."""

from kvpact.client.transport import TransportParams, channel_credentials

__all__ = ["TransportParams", "channel_credentials"]
