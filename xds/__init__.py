"""The mesh: its state, the Envoy configuration built from it, and the xDS adapters.

Pure core (no I/O library: the ``core`` contract in pyproject.toml): ``xds.state`` (the mesh
state and its transitions), ``xds.meshpolicy`` / ``xds.secretpolicy`` (policy documents),
``xds.index`` and ``xds.build`` (snapshots), ``xds.resources`` (xDS names and type URLs),
``xds.pmap`` (the persistent map of the state), ``xds.h2conn`` (sans-I/O HTTP/2 for gRPC
streams) and ``xds.adswire`` (request decoding).
Adapters: ``xds.cache`` and ``xds.publisher`` (state -> per-node snapshots), ``xds.server``
(the ADS protocol sessions and ``AdsServer``; counts through ``XdsMetrics``), ``xds.adsconn``
(``LeanAds``: the ADS port's asyncio HTTP/2 + TLS; grpclib serves ``AdsServer`` as fallback),
``xds.store`` / ``xds.store_pg`` (persistence),
``xds.kube`` (the Kubernetes adapter package; shared names in ``xds.kube.names``),
``xds.registrations`` (registration files). ``xds`` may import ``certs``, never ``sidecar`` or
the composition root ``attestmesh``.
"""

import os as _os
from pathlib import Path as _Path

from xds import native as _native

# the modules `make native` compiled run only while they match their sources (xds.native)
_native.activate(_Path(__file__).parent, _os.environ)
