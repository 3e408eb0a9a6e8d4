"""The sidecar's local SDS server: Envoy fetches ``workload-cert`` over a Unix socket.

The private key is generated inside the TEE and never leaves this process except over this
socket (mode 0600) to the Envoy beside it. Envoy reaches it through its static ``sds-local``
cluster with ``api_config_source: GRPC``, i.e. the
``envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets`` method. The stream protocol
(subscribed names, nonces, ACK/NACK) is the control plane's own :class:`xds.server.AdsSession`.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path

import grpclib.const
import grpclib.server
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from xds import pb
from xds.build import Snapshot
from xds.cache import SnapshotCache
from xds.resources import SDS_SERVICE, WORKLOAD_CERT, TypeUrl
from xds.server import serve_sotw_stream, warm

with warnings.catch_warnings():
    # generated code uses a pydantic 2.12-deprecated validator form; harmless, noisy
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import DataSource
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import Secret, TlsCertificate
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest

_LOCAL = "local"  # every stream on the socket is the local Envoy: one cache slot


def build_workload_secret(cert_chain_pem: bytes, key_pem: bytes) -> Secret:
    return Secret(
        name=WORKLOAD_CERT,
        tls_certificate=TlsCertificate(
            certificate_chain=DataSource(inline_bytes=cert_chain_pem),
            private_key=DataSource(inline_bytes=key_pem),
        ),
    )


class LocalSds:
    """grpclib service for SecretDiscoveryService.StreamSecrets, serving one secret."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._cache = SnapshotCache()
        self._metrics = metrics or Metrics()
        self.rotations = 0

    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        """Serve a new certificate chain (leaf first, then intermediates) and key; every connected
        Envoy receives it at once (new handshakes use it, open connections are untouched)."""
        packed = pb.pack(build_workload_secret(cert_chain_pem, key_pem), TypeUrl.SECRET)
        self._cache.set_snapshot(_LOCAL, Snapshot.of({TypeUrl.SECRET: {WORKLOAD_CERT: packed}}))
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


__all__ = ["LocalSds", "bind_private_unix_socket", "build_workload_secret", "start_sds"]
