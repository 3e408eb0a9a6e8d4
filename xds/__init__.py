"""The mesh: its state, the Envoy configuration built from it, and the xDS adapters.

Pure core (no I/O library: the ``core`` contract in pyproject.toml): ``xds.state`` (the mesh
state and its transitions), ``xds.meshpolicy`` / ``xds.secretpolicy`` (policy documents),
``xds.index`` and ``xds.build`` (snapshots), ``xds.resources`` (xDS names and type URLs).
Adapters: ``xds.cache`` and ``xds.publisher`` (state -> per-node snapshots), ``xds.server``
(the ADS server; counts through ``XdsMetrics``), ``xds.store`` / ``xds.store_pg`` (persistence),
``xds.kube`` (the Kubernetes adapter package; shared names in ``xds.kube.names``),
``xds.registrations`` (registration files). ``xds`` may import ``certs``, never ``sidecar`` or
the composition root ``attestmesh``.
"""
