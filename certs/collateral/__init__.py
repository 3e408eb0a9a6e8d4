"""Vendor collateral: trust roots, offline bundles, and online fetchers with an on-disk cache.

What others may import: ``certs.collateral.source`` (``CollateralSource``: the protocol the
control plane asks collateral through), ``certs.collateral.roots`` (``TrustRoots``,
``bundled_roots``, ``load_roots``: the pinned anchors handed to the verifiers),
``certs.collateral.cache``
(``DiskCache``, ``http_fetcher``), and the two fetchers, ``certs.collateral.intel_pcs``
(``PcsCollateralSource``: TCB info, QE identity and CRLs from Intel PCS) and
``certs.collateral.amd_kds`` (``KdsCollateralSource``: VCEK, cert_chain and CRL from AMD KDS).
They are adapters (HTTP, disk): they fetch and cache bytes, and read them only with the
evidence package's strict parsers (``certs.evidence.dcap``, ``certs.evidence.sev_snp``,
``certs.evidence.x509chain``) to learn expiry; verification stays with the verifiers.
"""
