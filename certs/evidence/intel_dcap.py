"""Old import path of ``certs.evidence.dcap``, kept only for importers outside the evidence
package's owners (attestmesh/tcb_monitor.py, sidecar/tee/gramine.py, benchmarks/bench_verify.py,
benchmarks/bench_beyond.py). New code imports ``certs.evidence.dcap``; delete this module when
those four do.
"""

from certs.evidence.dcap import (
    MAX_QUOTE_BYTES,
    TEE_TYPE_SGX,
    DcapVerifier,
    parse_collateral,
    parse_quote,
    quote_tee_type,
)

__all__ = [
    "MAX_QUOTE_BYTES",
    "TEE_TYPE_SGX",
    "DcapVerifier",
    "parse_collateral",
    "parse_quote",
    "quote_tee_type",
]
