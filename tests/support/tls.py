"""TLS material for the tests: a throwaway CA and certificates made with real openssl."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

OPENSSL = shutil.which("openssl")


def _openssl(*args: str | Path) -> None:
    assert OPENSSL is not None, (
        "the TLS tests make certificates with openssl: run `make system-deps`"
    )
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=60)


def make_certificates(
    directory: Path, server_ips: Sequence[str] = ("127.0.0.1",)
) -> dict[str, Path]:
    """A CA, and a server (localhost and ``server_ips``) and a client certificate signed
    by it."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    _openssl("req", "-x509", *key, "-keyout", ca_key, "-out", ca, "-days", "1",
             "-subj", "/CN=kvdefrag test CA")  # fmt: skip
    extensions = directory / "san.ext"
    names = ",".join(["DNS:localhost", *(f"IP:{ip}" for ip in server_ips)])
    extensions.write_text(f"subjectAltName={names}\n")
    paths = {"ca": ca}
    for name in ("server", "client"):
        csr = directory / f"{name}.csr"
        _openssl("req", *key, "-keyout", directory / f"{name}.key", "-out", csr,
                 "-subj", f"/CN={name}")  # fmt: skip
        cert = directory / f"{name}.pem"
        _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                 "-out", cert, "-days", "1", "-extfile", extensions)  # fmt: skip
        paths[name], paths[f"{name}_key"] = cert, directory / f"{name}.key"
    return paths


def vllm_mtls_settings(paths: dict[str, Path]) -> dict[str, str]:
    """The TLS variables of a vLLM engine whose ranks serve TCP with mutual TLS: each rank's
    service certificate and the CA it asks clients for, and the scheduler's client
    certificate and the CA it trusts (``paths`` from ``make_certificates``)."""
    from kvdefrag.vllm.config import CLIENT_TLS_ENV

    return {
        "KVDEFRAG_TLS_CERT_FILE": str(paths["server"]),
        "KVDEFRAG_TLS_KEY_FILE": str(paths["server_key"]),
        "KVDEFRAG_TLS_CLIENT_CA_FILE": str(paths["ca"]),
        CLIENT_TLS_ENV["root_certificates"]: str(paths["ca"]),
        CLIENT_TLS_ENV["certificate_chain"]: str(paths["client"]),
        CLIENT_TLS_ENV["private_key"]: str(paths["client_key"]),
    }
