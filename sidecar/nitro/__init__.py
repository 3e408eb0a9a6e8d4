"""The Nitro Enclaves runtime: an injected Nitro pod runs ``attestmesh nitro-parent`` beside
its enclave, and the enclave image starts with ``attestmesh enclave-init``.

What others may import: ``sidecar.nitro.config`` (the pure core: routes, the parent <-> enclave
control protocol, enclave sizing, restart backoff, readiness), ``sidecar.nitro.nitrocli``
(``nitro-cli`` command lines and output parsing, ``NitroCli``), ``sidecar.nitro.bridge`` (the
fixed-destination TCP <-> vsock byte bridges and their transports), ``sidecar.nitro.parent``
(``Parent``, ``ParentSettings``) and ``sidecar.nitro.enclave_init`` (``EnclaveInitSettings``,
``run``). The wiring is ``attestmesh.nitro_cmd``.
"""
