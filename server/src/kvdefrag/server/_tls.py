"""The server's TLS material: read, checked with OpenSSL, turned into gRPC credentials.

Every problem is an ``InvalidArgument`` naming the option and the file, raised before the
server binds: gRPC would only find out while binding, and say no more than that the bind
failed.
"""

from __future__ import annotations

import ssl

import grpc

from kvdefrag.common import InvalidArgument
from kvdefrag.server.config import ServiceConfig


def _read_file(option: str, path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as err:
        raise InvalidArgument(f"{option} {path!r} cannot be read: {err.strerror}") from err


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config (mTLS with a client CA), None without TLS.

    Raises:
        InvalidArgument: The TLS options are incomplete, or a file cannot be read or
            holds bad material (see ``_check_files``).
    """
    if config.tls_cert_file is None and config.tls_key_file is None:
        if config.tls_client_ca_file is not None:
            raise InvalidArgument(
                "tls_client_ca_file needs tls_cert_file and tls_key_file (the server's TLS)"
            )
        return None
    if config.tls_cert_file is None or config.tls_key_file is None:
        raise InvalidArgument("TLS needs both tls_cert_file and tls_key_file")
    cert = _read_file("tls_cert_file", config.tls_cert_file)
    key = _read_file("tls_key_file", config.tls_key_file)
    client_ca = (
        None
        if config.tls_client_ca_file is None
        else _read_file("tls_client_ca_file", config.tls_client_ca_file)
    )
    _check_files(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _check_files(cert_file: str, key_file: str, client_ca_file: str | None) -> None:
    """Loads the PEM files with OpenSSL, as gRPC will, to name a bad one.

    Raises:
        InvalidArgument: A file holds no certificate, the key is not an unencrypted PEM
            private key, or it does not match the certificate.
    """
    _check_certificates("tls_cert_file", cert_file)
    if client_ca_file is not None:
        _check_certificates("tls_client_ca_file", client_ca_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key gets an empty passphrase and fails (gRPC takes none).
        context.load_cert_chain(cert_file, key_file, password=lambda: b"")
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise InvalidArgument(
                f"tls_key_file {key_file!r} does not match the certificate in tls_cert_file "
                f"{cert_file!r}"
            ) from err
        raise InvalidArgument(
            f"tls_key_file {key_file!r} is not an unencrypted PEM private key ({err})"
        ) from err


def _check_certificates(option: str, path: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=path)
    except ssl.SSLError as err:
        raise InvalidArgument(f"{option} {path!r}: no certificate found in it ({err})") from err
