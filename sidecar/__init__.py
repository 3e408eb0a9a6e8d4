"""The sidecar: what runs beside (or inside) a workload's TEE.

What others may import: ``sidecar.agent`` (the attest/renew loop), ``sidecar.sds`` (the local
SDS server Envoy reads its certificate from, and ``check_sds``), ``sidecar.bootstrap`` and
``sidecar.envoy_proc`` (Envoy's bootstrap and process), ``sidecar.collectors`` / ``sidecar.tee``
(evidence from the platform's devices), ``sidecar.gpu``, ``sidecar.secrets``,
``sidecar.inject`` (the injection webhook, pure patches) and ``sidecar.nitro`` (the Nitro
enclave parent, bridge and enclave entry point). The sidecar may import ``certs`` and ``xds``,
never the composition root ``attestmesh``.
"""
