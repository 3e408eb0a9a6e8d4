"""attestmesh, the composition root: the CLI (``attestmesh.cli``), settings, the metrics
registry (``attestmesh.metrics``), the control-plane service (``attestmesh.controlplane``) and
the wiring of each mode (``serve``, ``kube_mode``, ``demo``, the ``*_cmd`` commands).

Public face: the ``attestmesh`` command. Nothing below imports this package (certs, xds and
sidecar are checked by ``lint-imports``, the ``root`` contract in pyproject.toml); adapters
count through narrow protocols (``attestmesh.controlplane.http.ApiMetrics``,
``xds.server.XdsMetrics``) that ``attestmesh.metrics.Metrics`` implements, and lower layers
take callbacks the root passes in.
"""
