"""The deployment's secret - where it comes from - and who may listen without one.

The secret is read from ``secret_file`` or ``VLLM_PD_SECRET`` (:func:`load_secret`), or made fresh
for a local cluster (:func:`write_new_secret`); what both ends of a connection then prove with it is
the protocol's handshake (protocol/auth_handshake.py). With no secret configured nothing of that
runs: a loopback-only deployment, see :func:`check_bind`; a side with a secret refuses a peer without
one, and says so.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping

from vllm_pd.errors import ConfigError
from vllm_pd.protocol.auth_handshake import DeploymentSecret

SECRET_ENV = "VLLM_PD_SECRET"
MIN_SECRET_NBYTES = 16


def load_secret(
    secret_file: str | None, key: str = "secret_file", env: Mapping[str, str] | None = None
) -> DeploymentSecret | None:
    """The secret from ``secret_file`` or the ``VLLM_PD_SECRET`` environment variable; None if
    neither is set. ConfigError naming ``key`` (or the variable) on an unreadable file, an empty
    or short secret, or both set to different values."""
    env = os.environ if env is None else env
    from_env = env.get(SECRET_ENV)
    from_file: bytes | None = None
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                from_file = f.read().strip()
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {secret_file!r}: {e.strerror or e}") from None
        _check_secret(from_file, f"{key} ({secret_file})")
    if from_env is not None:
        _check_secret(from_env.strip().encode(), SECRET_ENV)
        if from_file is not None and from_file != from_env.strip().encode():
            raise ConfigError(f"{key} and {SECRET_ENV} are both set, to different secrets; set one")
    if from_file is not None:
        return DeploymentSecret(from_file, f"{key} {secret_file}")
    if from_env is not None:
        return DeploymentSecret(from_env.strip().encode(), SECRET_ENV)
    return None


def _check_secret(value: bytes, where: str) -> None:
    if not value:
        raise ConfigError(f"{where}: the secret is empty")
    if len(value) < MIN_SECRET_NBYTES:
        raise ConfigError(
            f"{where}: the secret is {len(value)} bytes; use at least {MIN_SECRET_NBYTES} random "
            "bytes (e.g. `openssl rand -hex 32`)"
        )


def new_secret() -> str:
    """A fresh random secret (what ``vllm-pd up`` writes for its cluster)."""
    return secrets.token_hex(32)


def write_new_secret(path: str | os.PathLike[str]) -> str:
    """A fresh secret written to ``path``, readable by its owner only (mode 0600 from the start);
    returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also a file that was there before
        os.write(fd, new_secret().encode())
    finally:
        os.close(fd)
    return str(path)


# -- where a KV endpoint may listen ------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_bind(
    host: str, secret: DeploymentSecret | None, insecure_network: bool, key: str, insecure_key: str = "insecure_network"
) -> bool:
    """Whether listening on ``host`` is allowed: loopback always; beyond it only with a secret, or
    with ``insecure_network`` (True returned: the caller logs a warning). ConfigError naming ``key``."""
    if secret is not None or is_loopback(host):
        return False
    if insecure_network:
        return True
    raise ConfigError(
        f"{key}: {host!r} is reachable from other hosts, and no deployment secret is set: anyone "
        f"who can reach it could read, write or release KV. Set {SECRET_ENV} (or secret_file), "
        f"bind to 127.0.0.1, or set {insecure_key} to accept that"
    )


INSECURE_WARNING = (
    "%s listens on %s without a deployment secret (%s): any process that reaches it can read, "
    "write and release KV. Set %s or secret_file to require one."
)
