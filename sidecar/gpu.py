"""The agent's side of composite CPU + GPU attestation (``certs.evidence.composite``).

``GpuAttachedSource`` wraps the CVM's evidence source (SEV-SNP or TDX): it collects the CPU
report for the binding first, then asks each confidential GPU for an SPDM measurement report
signed over the nonce derived from that binding (GPU ``i`` of ``n``), and sends the GPU reports
and device certificate chains as the ``gpu<i>.*`` collateral entries of the same attestation.

The device seam is ``GpuDevice``: NVIDIA's interface (NVML's confidential-computing GPU
attestation report and certificate calls, as the nvtrust tools use them) goes behind it in
production; tests fake it there with test-signed reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from certs.errors import AttestmeshError
from certs.evidence.composite import MAX_GPUS, GpuEvidence, gpu_collateral, gpu_nonce
from sidecar.agent import Evidence, EvidenceSource

CPU_TEES = ("sev-snp", "tdx")


class GpuDevice(Protocol):
    """One confidential GPU: an SPDM GET_MEASUREMENTS exchange signed over ``nonce`` (request
    followed by response, raw bytes), and its device certificate chain (PEM, leaf first)."""

    def attestation_report(self, nonce: bytes) -> bytes: ...

    def certificate_chain(self) -> bytes: ...


class GpuAttachedSource:
    """CPU evidence with every GPU's report attached, all bound to one challenge."""

    def __init__(self, cpu: EvidenceSource, gpus: Sequence[GpuDevice]) -> None:
        if not 1 <= len(gpus) <= MAX_GPUS:
            raise AttestmeshError("usage", f"1 to {MAX_GPUS} GPUs can attach, not {len(gpus)}")
        self._cpu = cpu
        self._gpus = tuple(gpus)

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        cpu = self._cpu.collect(report_data, nonce=nonce, spki=spki)
        if cpu.tee not in CPU_TEES:
            raise AttestmeshError("tee_unsupported", f"GPUs attach to {CPU_TEES}, not {cpu.tee}")
        clash = sorted(k for k in cpu.collateral if k.startswith("gpu"))
        if clash:
            raise AttestmeshError("tee_unsupported", f"CPU collateral uses GPU keys {clash}")
        n = len(self._gpus)
        attached = [
            GpuEvidence(
                gpu.attestation_report(gpu_nonce(report_data, i, n)), gpu.certificate_chain()
            )
            for i, gpu in enumerate(self._gpus)
        ]
        return Evidence(cpu.tee, cpu.evidence, {**cpu.collateral, **gpu_collateral(attached)})
