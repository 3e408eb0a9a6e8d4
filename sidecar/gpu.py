"""The agent's side of composite CPU + GPU attestation (``certs.evidence.composite``).

``GpuAttachedSource`` wraps the CVM's evidence source (SEV-SNP or TDX): it collects the CPU
report for the binding first, then asks each confidential GPU for an SPDM measurement report
signed over the nonce derived from that binding (GPU ``i`` of ``n``), and sends the GPU reports
and device certificate chains as the ``gpu<i>.*`` collateral entries of the same attestation.

The device seam is ``GpuDevice``. In production it is ``NvidiaSdkGpu``: NVIDIA's attestation
SDK (nvtrust), whose evidence generation asks the driver (NVML) for each GPU's signed SPDM
measurements over a nonce; tests fake the SDK call with test-signed reports.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import serialization

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


GenerateEvidence = Callable[[str], Sequence[Mapping[str, Any]]]
"""NVIDIA's attestation SDK (nvtrust ``nv_attestation_sdk``): ``generate_evidence(nonce hex)``
returns one entry per GPU with ``attestationReportHexStr`` (the SPDM request + response, hex)
and ``certChainBase64Encoded`` (the device certificate chain)."""


class NvidiaSdkGpu:
    """GPU ``index`` through NVIDIA's attestation SDK. The SDK asks every GPU for a report over
    the one nonce it is given; this device takes its own entry, so each GPU signs its own
    derived nonce (one SDK call per GPU)."""

    def __init__(self, index: int, generate: GenerateEvidence) -> None:
        self._index = index
        self._generate = generate
        self._chain: bytes | None = None

    def attestation_report(self, nonce: bytes) -> bytes:
        try:
            items = list(self._generate(nonce.hex()))
        except Exception as exc:  # a vendor library: any failure of it means "no GPU"
            raise AttestmeshError("gpu_unavailable", f"NVIDIA SDK: {exc!r}") from None
        if len(items) <= self._index:
            raise AttestmeshError(
                "gpu_unavailable", f"the NVIDIA SDK reports {len(items)} GPUs, not gpu{self._index}"
            )
        item = items[self._index]
        report = item.get("attestationReportHexStr")
        chain = item.get("certChainBase64Encoded")
        if not isinstance(report, str) or not isinstance(chain, str):
            raise AttestmeshError(
                "gpu_unavailable", "the NVIDIA SDK's evidence has no report/chain"
            )
        try:
            self._chain = chain_pem(base64.b64decode(chain, validate=True))
            return bytes.fromhex(report)
        except (ValueError, binascii.Error) as exc:
            raise AttestmeshError("gpu_unavailable", f"unreadable NVIDIA evidence: {exc}") from None

    def certificate_chain(self) -> bytes:
        if self._chain is None:
            raise AttestmeshError("gpu_unavailable", "no report collected yet")
        return self._chain


def chain_pem(raw: bytes) -> bytes:
    """A device chain as PEM: already PEM, or DER certificates back to back."""
    if raw.lstrip().startswith(b"-----BEGIN"):
        return raw
    out, pos = [], 0
    while pos < len(raw):
        if raw[pos] != 0x30 or pos + 2 > len(raw):
            raise ValueError("not a DER certificate sequence")
        first = raw[pos + 1]
        if first < 0x80:
            end = pos + 2 + first
        else:
            n = first & 0x7F
            if not 1 <= n <= 3:
                raise ValueError("bad DER length")
            end = pos + 2 + n + int.from_bytes(raw[pos + 2 : pos + 2 + n], "big")
        if end > len(raw):
            raise ValueError("truncated DER certificate")
        cert = x509.load_der_x509_certificate(raw[pos:end])
        out.append(cert.public_bytes(serialization.Encoding.PEM))
        pos = end
    if not out:
        raise ValueError("empty certificate chain")
    return b"".join(out)


def nvidia_sdk_gpus(count: int, generate: GenerateEvidence | None = None) -> list[GpuDevice]:
    """``count`` GPUs through NVIDIA's attestation SDK (imported here: only an agent given
    ``--gpus`` needs it)."""
    if generate is None:
        try:
            from nv_attestation_sdk.gpu import attest_gpu_remote  # type: ignore[import-not-found]
        except ImportError:
            raise AttestmeshError(
                "usage", "--gpus needs NVIDIA's attestation SDK (pip install nv-attestation-sdk)"
            ) from None
        generate = attest_gpu_remote.generate_evidence
    return [NvidiaSdkGpu(i, generate) for i in range(count)]
