"""TLS connections against a local TLS server (no broker): what verification refuses, and how."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rmq_async import TlsVerificationError
from rmq_async.remoting.connection import Connection
from rmq_async.remoting.tls import client_ssl_context
from tests.tls_certs import CertAuthority, issue_server_cert, make_ca


@pytest.fixture(scope="module")
def ca() -> CertAuthority:
    return make_ca("unit CA")


async def _serve(cert: Path, key: Path) -> tuple[asyncio.Server, int]:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes away
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def servers(ca: CertAuthority, tmp_path: Path) -> AsyncIterator[dict[str, int]]:
    """Three servers: a certificate for 127.0.0.1, one for localhost only (no IP SAN), and one
    for 127.0.0.1 from another CA."""
    ports = {}
    running = []
    for name, issuer, ips in (("ip", ca, ("127.0.0.1",)), ("dns-only", ca, ()),
                              ("other-ca", make_ca("other CA"), ("127.0.0.1",))):
        cert, key = issue_server_cert(issuer, tmp_path, ips=ips, stem=name)
        server, ports[name] = await _serve(cert, key)
        running.append(server)
    yield ports
    for server in running:
        server.close()
        await server.wait_closed()


async def test_verified_connection_and_refusals(ca: CertAuthority, tmp_path: Path,
                                                servers: dict[str, int]) -> None:
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.cert_pem)
    ctx = client_ssl_context(tls=True, tls_ca_file=ca_file)
    assert ctx is not None

    conn = await Connection.open(f"127.0.0.1:{servers['ip']}", ssl=ctx, connect_timeout=5)
    ssl_object = conn._transport.get_extra_info("ssl_object")  # type: ignore[union-attr]
    assert ("IP Address", "127.0.0.1") in ssl_object.getpeercert()["subjectAltName"]
    await conn.close()

    for name, reason in (("dns-only", "IP address mismatch"),
                         ("other-ca", "unable to get local issuer certificate")):
        addr = f"127.0.0.1:{servers[name]}"
        with pytest.raises(TlsVerificationError) as info:
            await Connection.open(addr, ssl=ctx, connect_timeout=5)
        assert info.value.addr == addr and reason in info.value.reason, str(info.value)
        assert addr in str(info.value)

    # Verification off: any of them is accepted.
    loose = client_ssl_context(tls=True, tls_verify=False)
    assert loose is not None
    for name in servers:
        conn = await Connection.open(f"127.0.0.1:{servers[name]}", ssl=loose, connect_timeout=5)
        await conn.close()
