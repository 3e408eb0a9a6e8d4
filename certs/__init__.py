"""Attested issuance: who may hold a mesh certificate, and the CA that signs it.

The lowest layer: it imports neither ``xds``, ``sidecar`` nor the composition root (the
``certs`` and ``root`` contracts in pyproject.toml, no exceptions). What others may import:

- ``certs.errors`` (the error hierarchy, bounded ``reason`` vocabulary) and ``certs.standing``
  (a workload's ``Status`` and the refusals that follow from it);
- pure core (no I/O library: the ``core`` contract): ``certs.evidence`` (verifiers ->
  ``Claims``), ``certs.policy`` (appraisal), ``certs.binding``, ``certs.ca`` (certificate
  templates and the CA);
- the issuance decision and its parts: ``certs.issuance`` (``AttestRequest``), ``certs.ear``,
  ``certs.nonces``, ``certs.tcb_reeval``, ``certs.sealing``;
- adapters: ``certs.collateral`` (vendor collateral fetchers), ``certs.keystore`` /
  ``certs.openbao`` (CA key storage), ``certs.kbs`` (the key broker's protocol). The
  attestation API over HTTP and the secret-release adapters read the mesh state, so they live
  above it, beside the service they serve: ``attestmesh.controlplane`` (``http``, ``secrets``,
  ``kbs``).
"""
