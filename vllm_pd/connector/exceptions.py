"""Every exception the connector and its transports raise, in one module."""

from __future__ import annotations


class PDError(Exception):
    """Base of all vllm-pd connector errors."""


class ConfigError(PDError, ValueError):
    """A bad key or value in ``kv_connector_extra_config``; the message names it."""


class TransportError(PDError):
    """A transfer did not complete; the KV it carried must not be used."""


class PeerUnreachable(TransportError):
    """Could not connect to the peer's endpoint."""


class PeerClosed(TransportError):
    """The peer closed the connection or died mid-transfer."""


class TransferTimeout(TransportError):
    """The transfer did not complete before its deadline."""


class TransferCorrupted(TransportError):
    """Length or checksum of received block bytes did not match."""


class AuthFailed(TransportError):
    """A connection's peer did not prove it holds the deployment secret (or a message's seal
    was wrong): the connection is closed and nothing of it is used."""


class TransferRejected(TransportError):
    """The peer refused the transfer (unknown transfer id, no space, released)."""
