"""Where the server listens: unix sockets (0600, stale, taken), TCP, TLS and mTLS."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.server._server import parse_address
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.server import Serve
from support.tls import make_certificates


def get_stats(address: str, credentials: grpc.ChannelCredentials | None = None) -> Any:
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        return pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def test_unix_socket_is_private_and_removed_on_stop(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    handle = serve(f"unix:{path}")
    assert handle.address == f"unix:{path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert get_stats(handle.address).epoch == handle.epoch
    handle.stop(0)
    assert not path.exists()


def test_stale_socket_file_is_replaced(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # a socket file nobody listens on, as after a crash
    handle = serve(f"unix:{path}")
    assert get_stats(handle.address).epoch == handle.epoch


def test_socket_of_a_live_server_is_refused(serve: Serve, tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/kv.sock"
    first = serve(address)
    with pytest.raises(OSError) as info:
        serve(address)
    assert info.value.errno == errno.EADDRINUSE and "taken" in str(info.value)
    assert get_stats(address).epoch == first.epoch


def test_a_file_that_is_not_a_socket_is_left_alone(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    path.write_text("precious")
    with pytest.raises(InvalidArgument, match="not a socket"):
        serve(f"unix:{path}")
    assert path.read_text() == "precious"


def test_tcp_port_zero_reports_the_real_port(serve: Serve) -> None:
    handle = serve("127.0.0.1:0")
    host, port = handle.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert get_stats(handle.address).epoch == handle.epoch


def test_taken_tcp_port_is_refused(serve: Serve) -> None:
    first = serve("127.0.0.1:0")
    with pytest.raises(OSError) as info:
        serve(first.address)
    assert info.value.errno == errno.EADDRINUSE
    assert get_stats(first.address).epoch == first.epoch


def test_non_loopback_tcp_needs_tls_or_insecure(serve: Serve) -> None:
    with pytest.raises(InvalidArgument, match="--insecure"):
        serve("0.0.0.0:0")
    handle = serve("0.0.0.0:0", insecure=True)
    port = handle.address.rsplit(":", 1)[1]
    assert get_stats(f"127.0.0.1:{port}").epoch == handle.epoch


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("unix:///tmp/a.sock", ("/tmp/a.sock", True)),
        ("unix:/tmp/b.sock", ("/tmp/b.sock", True)),
        ("localhost:5", (None, True)),
        ("[::1]:5", (None, True)),
        ("127.0.0.9:5", (None, True)),
        ("10.1.2.3:5", (None, False)),
        ("example.com:5", (None, False)),
    ],
)
def test_parse_address(address: str, expected: tuple[str | None, bool]) -> None:
    parsed = parse_address(address)
    assert (parsed.socket_path, parsed.is_loopback) == expected


@pytest.mark.parametrize("address", ["unix:", "nohost", ":50051", "host:port", "host:70000"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(InvalidArgument, match="address"):
        parse_address(address)


# --- TLS --------------------------------------------------------------------------------
def test_tls_serves_a_non_loopback_address(serve: Serve, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    handle = serve(
        "0.0.0.0:0", tls_cert_file=str(certs["server"]), tls_key_file=str(certs["server_key"])
    )
    port = handle.address.rsplit(":", 1)[1]
    trusted = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
    assert get_stats(f"localhost:{port}", trusted).epoch == handle.epoch
    with pytest.raises(grpc.RpcError):
        get_stats(f"localhost:{port}")  # plain text is not served


def test_mtls_requires_a_client_certificate(serve: Serve, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    handle = serve(
        "127.0.0.1:0",
        tls_cert_file=str(certs["server"]),
        tls_key_file=str(certs["server_key"]),
        tls_client_ca_file=str(certs["ca"]),
    )
    target = f"localhost:{handle.address.rsplit(':', 1)[1]}"
    ca = certs["ca"].read_bytes()
    with pytest.raises(grpc.RpcError) as info:
        get_stats(target, grpc.ssl_channel_credentials(root_certificates=ca))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=certs["client_key"].read_bytes(),
        certificate_chain=certs["client"].read_bytes(),
    )
    assert get_stats(target, client).epoch == handle.epoch


def test_incomplete_tls_options_are_refused(serve: Serve, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="tls_key_file"):
        serve("127.0.0.1:0", tls_cert_file=str(tmp_path / "cert.pem"))
    with pytest.raises(InvalidArgument, match="tls_client_ca_file"):
        serve("127.0.0.1:0", tls_client_ca_file=str(tmp_path / "ca.pem"))
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(InvalidArgument, match="cannot be read"):
        serve("127.0.0.1:0", tls_cert_file=missing, tls_key_file=missing)
    assert not os.listdir(tmp_path)
