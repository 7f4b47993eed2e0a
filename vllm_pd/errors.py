"""The one exception tree of vllm-pd: every error the package raises on purpose derives from :class:`PDError`.

This module sits at the bottom layer (no imports from the package, torch-free), so every part of
the package can import it without a circle. The branches are defined here; a leaf that belongs to
one part of the package (``TransferParamsError``, ``BackendError``, ``ProfileError``, ...) is
defined beside the code that raises it and derives from one of these branches.

A branch keeps the builtin base its errors had before the tree existed (``ConfigError`` and
``ProtocolError`` are ``ValueError``\\ s), so an ``except ValueError`` written by a caller still
catches what it caught. The tree is listed in docs/design/names.md ("Errors").
"""

from __future__ import annotations


class PDError(Exception):
    """Base of every error vllm-pd raises on purpose."""


class ConfigError(PDError, ValueError):
    """A bad key or value in a configuration (connector extra config, proxy YAML, CLI flag); the message names it."""


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


class ProtocolError(PDError, ValueError):
    """Something two processes exchange (transfer params, a frame, a header, an SSE stream) breaks its protocol."""


class StoreError(PDError, ValueError):
    """The KV store was asked for something it cannot do (bad key, unknown block, wrong geometry)."""


class RouterError(PDError):
    """The proxy/router branch: a client-facing ``ProxyError``, a failed backend exchange, a Kubernetes API error."""


class PlannerError(PDError):
    """The planner could not profile, read a workload or measure."""


class OpsError(PDError):
    """A custom op was called with bad input or its backend failed."""
