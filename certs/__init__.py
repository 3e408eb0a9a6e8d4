"""Attested issuance: who may hold a mesh certificate, and the CA that signs it.

The lowest layer: it imports neither ``xds`` nor ``sidecar`` (the ``certs`` contract in
pyproject.toml; the secret-release adapters are its listed exceptions). What others may import:

- ``certs.errors`` (the error hierarchy, bounded ``reason`` vocabulary) and ``certs.standing``
  (a workload's ``Status`` and the refusals that follow from it);
- pure core (no I/O library: the ``core`` contract): ``certs.evidence`` (verifiers ->
  ``Claims``), ``certs.policy`` (appraisal), ``certs.binding``, ``certs.ca`` (certificate
  templates and the CA);
- the issuance decision and its parts: ``certs.issuance`` (``AttestRequest``), ``certs.ear``,
  ``certs.nonces``, ``certs.tcb_reeval``, ``certs.sealing``;
- adapters: ``certs.api`` (the attestation API over HTTP; ``build_app``), ``certs.collateral``
  (vendor collateral fetchers), ``certs.keystore`` / ``certs.openbao`` (CA key storage),
  ``certs.secrets_api`` / ``certs.kbs_api`` / ``certs.kbs`` (secret release).
"""
