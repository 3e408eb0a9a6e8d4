"""TEE evidence verifiers: pure, bytes in, ``Claims`` out (no I/O library: the ``core``
contract in pyproject.toml).

What others may import: ``certs.evidence.claims`` (``Claims``, ``Tee``), ``certs.evidence.
registry`` (the verifier for a TEE), ``certs.evidence.composite`` (CPU + GPU evidence), and
``certs.evidence.sim`` (the simulated TEE of tests and the demo). The per-vendor modules
(``nitro``, ``sev_snp``, ``tdx``, ``sgx_dcap``, ``nvidia_gpu``) and the ``dcap`` package under
``tdx``/``sgx_dcap`` are reached through the registry; ``dcap`` (its ``__all__``) and
``sev_snp`` are also imported by what parses the same structures (the collateral fetchers, TCB
re-appraisal and monitoring, the Gramine quote source).

``x509chain`` is the one X.509/DER toolkit under every verifier and the collateral code: the
strict certificate and CRL loaders, the DER helpers, the validity check (``check_window``, time
as an argument) and the chain verifier (``ChainVerifier`` -> ``VerifiedChain``). Nothing else
here walks DER, verifies a chain or checks a validity period.
"""
