"""A throwaway PKI for TLS tests and benchmarks: a CA and certificates it signed (openssl CLI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_pd.connector.transport.tls_stream import TlsSettings


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(folder: Path, name: str = "ca") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        "-subj",
        f"/CN=vllm-pd test {name}",
        cwd=folder,
    )
    return folder / f"{name}.pem"


def issue(folder: Path, name: str, ca: str = "ca") -> TlsSettings:
    """A certificate for ``name`` signed by ``ca`` (made by :func:`make_ca` in ``folder``)."""
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=folder,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "2",
        cwd=folder,
    )
    return TlsSettings(str(folder / f"{name}.pem"), str(folder / f"{name}.key"), str(folder / f"{ca}.pem"))
