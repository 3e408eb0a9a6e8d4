"""The sidecar's local SDS server: Envoy fetches ``workload-cert`` over a Unix socket.

Two secrets of one key: ``workload-cert`` (leaf and intermediate, what the mesh's peers are
shown: they trust the root alone) and ``workload-leaf-cert`` (the leaf alone, what Envoy shows
the control plane, whose ADS port trusts the live intermediates: the server keeps the peer's
chain for the stream's life, so one certificate less is ~5 KB less per ADS stream).

The private key is generated inside the TEE and never leaves this process except over this
socket (mode 0600) to the Envoy beside it. Envoy reaches it through its static ``sds-local``
cluster with ``api_config_source: GRPC``, i.e. the
``envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets`` method. The stream protocol
(subscribed names, nonces, ACK/NACK) is the control plane's own :class:`xds.server.AdsSession`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import warnings
from datetime import datetime
from pathlib import Path

import grpclib.const
import grpclib.exceptions
import grpclib.server
from cryptography import x509
from grpclib.client import Channel
from pydantic.warnings import PydanticDeprecatedSince212

from certs.errors import AttestmeshError
from xds import pb
from xds.build import Snapshot
from xds.cache import SnapshotCache
from xds.resources import SDS_SERVICE, WORKLOAD_CERT, WORKLOAD_LEAF_CERT, TypeUrl
from xds.server import UNCOUNTED, XdsMetrics, serve_sotw_stream, warm

with warnings.catch_warnings():
    # generated code uses a pydantic 2.12-deprecated validator form; harmless, noisy
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import DataSource, Node
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import Secret, TlsCertificate
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse

_LOCAL = "local"  # every stream on the socket is the local Envoy: one cache slot


_PEM_END = b"-----END CERTIFICATE-----"


def leaf_pem(cert_chain_pem: bytes) -> bytes:
    """The first certificate of a PEM chain (leaf first), ending with a newline; anything that
    is not PEM as it is."""
    end = cert_chain_pem.find(_PEM_END)
    if end < 0:
        return cert_chain_pem
    return cert_chain_pem[: end + len(_PEM_END)] + b"\n"


def build_workload_secret(
    cert_chain_pem: bytes, key_pem: bytes, name: str = WORKLOAD_CERT
) -> Secret:
    return Secret(
        name=name,
        tls_certificate=TlsCertificate(
            certificate_chain=DataSource(inline_bytes=cert_chain_pem),
            private_key=DataSource(inline_bytes=key_pem),
        ),
    )


class LocalSds:
    """grpclib service for SecretDiscoveryService.StreamSecrets, serving the workload's key
    with its full chain (``workload-cert``) and with its leaf alone (``workload-leaf-cert``)."""

    def __init__(self, metrics: XdsMetrics | None = None) -> None:
        self._cache = SnapshotCache()
        self._metrics = UNCOUNTED if metrics is None else metrics
        self.rotations = 0

    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        """Serve a new certificate chain (leaf first, then intermediates) and key; every connected
        Envoy receives it at once (new handshakes use it, open connections are untouched).
        Both secrets change together: the leaf-only one is the chain's first certificate."""
        full = pb.pack(build_workload_secret(cert_chain_pem, key_pem), TypeUrl.SECRET)
        leaf = pb.pack(
            build_workload_secret(leaf_pem(cert_chain_pem), key_pem, WORKLOAD_LEAF_CERT),
            TypeUrl.SECRET,
        )
        self._cache.set_snapshot(
            _LOCAL, Snapshot.of({TypeUrl.SECRET: {WORKLOAD_CERT: full, WORKLOAD_LEAF_CERT: leaf}})
        )
        self.rotations += 1

    @property
    def ready(self) -> bool:
        return self._cache.get(_LOCAL) is not None

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/{SDS_SERVICE}/StreamSecrets": grpclib.const.Handler(
                self._stream,
                grpclib.const.Cardinality.STREAM_STREAM,
                DiscoveryRequest,
                pb.Encoded,
            )
        }

    async def _stream(self, stream: grpclib.server.Stream[DiscoveryRequest, pb.Encoded]) -> None:
        await serve_sotw_stream(
            stream, self._cache, self._metrics, time.monotonic, lambda _first: _LOCAL
        )


def bind_private_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` that only this user can connect to (0600 from the
    moment it exists: bound under a restrictive umask, then chmod'ed to be explicit)."""
    if path.is_socket():
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    path.chmod(0o600)
    sock.listen(16)
    sock.setblocking(False)
    return sock


async def start_sds(sds: LocalSds, path: Path) -> grpclib.server.Server:
    """Listen on ``path``. The caller closes the server
    (``server.close(); await server.wait_closed()``) and may unlink ``path``."""
    pb.install_validator_cache()
    warm()
    server = grpclib.server.Server([sds])
    await server.start(sock=bind_private_unix_socket(path))
    return server


async def check_sds(path: Path, *, now: datetime, timeout_s: float) -> x509.Certificate:
    """Fetch the workload certificate from the SDS socket at ``path`` as Envoy does; return its
    leaf when one is served and valid at ``now``, else raise ``AttestmeshError``."""
    channel = Channel(path=str(path))
    try:
        async with asyncio.timeout(timeout_s):
            async with channel.request(
                f"/{SDS_SERVICE}/StreamSecrets",
                grpclib.const.Cardinality.STREAM_STREAM,
                DiscoveryRequest,
                DiscoveryResponse,
            ) as stream:
                await stream.send_message(
                    DiscoveryRequest(
                        node=Node(id="attestmesh-agent-check"),
                        type_url=TypeUrl.SECRET,
                        resource_names=[WORKLOAD_CERT],
                    )
                )
                resp = await stream.recv_message()
                await stream.cancel()
    except TimeoutError:
        raise AttestmeshError(
            "sds_not_ready", f"{path} served no certificate within {timeout_s}s"
        ) from None
    except (OSError, grpclib.exceptions.GRPCError, grpclib.exceptions.StreamTerminatedError) as exc:
        raise AttestmeshError("sds_not_ready", f"{path}: {exc}") from None
    finally:
        channel.close()
    chain = b""
    for res in resp.resources if resp is not None else []:
        msg = res.unpack()
        if isinstance(msg, Secret) and msg.name == WORKLOAD_CERT and msg.tls_certificate:
            source = msg.tls_certificate.certificate_chain
            chain = (source.inline_bytes or b"") if source is not None else b""
    try:
        leaf = x509.load_pem_x509_certificates(chain)[0]
    except (ValueError, IndexError):
        raise AttestmeshError("sds_not_ready", f"{path} served no certificate") from None
    if not leaf.not_valid_before_utc <= now < leaf.not_valid_after_utc:
        raise AttestmeshError(
            "sds_not_ready", f"the certificate {path} serves expired {leaf.not_valid_after_utc}"
        )
    return leaf


__all__ = [
    "LocalSds",
    "bind_private_unix_socket",
    "build_workload_secret",
    "check_sds",
    "leaf_pem",
    "start_sds",
]
