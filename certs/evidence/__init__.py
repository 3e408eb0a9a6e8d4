"""TEE evidence verifiers: pure, bytes in, ``Claims`` out (no I/O library: the ``core``
contract in pyproject.toml).

What others may import: ``certs.evidence.claims`` (``Claims``, ``Tee``), ``certs.evidence.
registry`` (the verifier for a TEE), ``certs.evidence.composite`` (CPU + GPU evidence), and
``certs.evidence.sim`` (the simulated TEE of tests and the demo). The per-vendor modules
(``nitro``, ``sev_snp``, ``tdx``, ``sgx_dcap``, ``intel_dcap``, ``nvidia_gpu``) and
``x509chain`` are reached through the registry; ``intel_dcap`` and ``sev_snp`` are also
imported by what parses the same structures (the collateral fetchers, TCB re-appraisal and
monitoring, the Gramine quote source).
"""
