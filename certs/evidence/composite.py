"""Composite attestation: a confidential VM (SEV-SNP or TDX) and its NVIDIA H100 GPUs in
confidential-computing mode, presented in one attestation. Pure (time comes in as an argument).

Wire form (the attestation API's existing fields, nothing new to parse before authentication):
``tee`` and ``evidence`` are the CPU's; each GPU ``i`` (0-based, at most ``MAX_GPUS``) adds the
collateral entries ``gpu<i>.evidence`` (its SPDM GET_MEASUREMENTS request + response, raw or
hex, ``certs.evidence.nvidia_gpu``) and ``gpu<i>.cert_chain`` (its device certificate chain,
PEM). Every other collateral entry is the CPU verifier's.

Binding: the CPU report carries ``report_data = binding(nonce, key)`` (``certs.binding``); GPU
``i`` of ``n`` must have been asked for the SPDM nonce::

    gpu_nonce(report_data, i, n) = SHA-256("attestmesh/v1/gpu-nonce\\0" || report_data || n || i)

(``n`` and ``i`` one byte each). The GPU signs its request nonce, the CPU signs its report data,
and the control plane checks both against the same fresh challenge and CSR key: a GPU report
from another attestation (other nonce), a CPU report of another attestation (other report data),
GPUs reordered (other ``i``) or a GPU left out (other ``n``) all fail. The agent derives the same
nonces (``sidecar/gpu.py``).

Claims: the CPU's, plus per GPU the measurements ``gpu<i>.measurement_<index>`` and the details
``gpu<i>.<detail>`` (driver and VBIOS versions, FWID, the report's SHA-256), and the details
``attached_tees = "nvidia-gpu"`` and ``gpu_count``. ``certs.policy`` appraises them
(``requires: [sev-snp, nvidia-gpu]``, ``referenceValues.nvidiaGpu`` for every GPU); mesh rules
match them by those measurement keys; both claim sets go into the leaf's claims extension and
EAR (one submod per GPU).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Collateral, Detail, Tee, Verifier
from certs.evidence.nvidia_gpu import COLLATERAL_CERT_CHAIN, NONCE_LEN

GPU_NONCE_DOMAIN = b"attestmesh/v1/gpu-nonce\x00"
MAX_GPUS = 8
CPU_TEES = frozenset({Tee.SEV_SNP, Tee.TDX})
ATTACHED_KEY = "attached_tees"
GPU_COUNT_KEY = "gpu_count"
_GPU_KEY = re.compile(r"^gpu([0-9]+)\.(evidence|cert_chain)$")
_GPU_DETAILS = ("driver_version", "vbios_version", "fwid", "chip_sku", "project")


def gpu_nonce(report_data: bytes, index: int, count: int) -> bytes:
    """The SPDM request nonce GPU ``index`` of ``count`` must sign (32 bytes)."""
    if len(report_data) < 64:
        raise ValueError("report_data must be the 64-byte key binding")
    if not 0 <= index < count <= MAX_GPUS:
        raise ValueError(f"GPU index {index} of {count} (at most {MAX_GPUS} GPUs)")
    digest = hashlib.sha256(GPU_NONCE_DOMAIN + report_data[:64] + bytes([count, index])).digest()
    assert len(digest) == NONCE_LEN
    return digest


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    evidence: bytes
    cert_chain: bytes


def split_collateral(collateral: Collateral) -> tuple[dict[str, bytes], list[GpuEvidence]]:
    """(the CPU's collateral, the GPUs' evidence in index order). Raises EvidenceFormatError
    on gaps, an evidence without its chain, or more than ``MAX_GPUS``."""
    cpu: dict[str, bytes] = {}
    parts: dict[int, dict[str, bytes]] = {}
    for key, value in collateral.items():
        m = _GPU_KEY.fullmatch(key)
        if m is None:
            if key.startswith("gpu"):
                raise EvidenceFormatError(
                    "composite_invalid", f"unknown GPU collateral entry {key!r}"
                )
            cpu[key] = value
            continue
        index = int(m.group(1))
        if index >= MAX_GPUS or m.group(1) != str(index):
            raise EvidenceFormatError("composite_invalid", f"GPU index {m.group(1)} out of range")
        parts.setdefault(index, {})[m.group(2)] = value
    if sorted(parts) != list(range(len(parts))):
        raise EvidenceFormatError(
            "composite_invalid", f"GPU indexes must be 0..n-1, got {sorted(parts)}"
        )
    gpus = []
    for i in range(len(parts)):
        got = parts[i]
        if set(got) != {"evidence", "cert_chain"}:
            missing = sorted({"evidence", "cert_chain"} - set(got))
            raise EvidenceFormatError("composite_invalid", f"gpu{i} lacks {', '.join(missing)}")
        gpus.append(GpuEvidence(got["evidence"], got["cert_chain"]))
    return cpu, gpus


def gpu_collateral(gpus: Sequence[GpuEvidence]) -> dict[str, bytes]:
    """The collateral entries that carry ``gpus`` (the agent's side of ``split_collateral``)."""
    out: dict[str, bytes] = {}
    for i, g in enumerate(gpus):
        out[f"gpu{i}.evidence"] = g.evidence
        out[f"gpu{i}.cert_chain"] = g.cert_chain
    return out


def merge_claims(cpu: Claims, gpus: Sequence[Claims]) -> Claims:
    """The CPU's claims with every GPU's attached under ``gpu<i>.`` keys."""
    measurements = dict(cpu.measurements)
    details: dict[str, Detail] = dict(cpu.details)
    for i, g in enumerate(gpus):
        for key, value in g.measurements.items():
            measurements[f"gpu{i}.{key}"] = value
        for key in _GPU_DETAILS:
            if key in g.details:
                details[f"gpu{i}.{key}"] = g.details[key]
        details[f"gpu{i}.evidence_sha256"] = g.evidence_sha256
    details[ATTACHED_KEY] = Tee.NVIDIA_GPU.value
    details[GPU_COUNT_KEY] = len(gpus)
    return replace(cpu, measurements=measurements, details=details)


@dataclass(frozen=True, slots=True)
class AttachedGpu:
    """One GPU's claims as carried in composite claims (for the certificate's EAR)."""

    index: int
    measurements: Mapping[str, str]
    details: Mapping[str, Detail]


def attached_gpus(claims: Claims) -> list[AttachedGpu]:
    """The GPUs attached to composite ``claims`` (none for plain claims)."""
    count = claims.details.get(GPU_COUNT_KEY)
    if claims.details.get(ATTACHED_KEY) != Tee.NVIDIA_GPU.value or not isinstance(count, int):
        return []
    out = []
    for i in range(min(count, MAX_GPUS)):
        prefix = f"gpu{i}."
        out.append(
            AttachedGpu(
                i,
                {
                    k[len(prefix) :]: v
                    for k, v in claims.measurements.items()
                    if k.startswith(prefix)
                },
                {k[len(prefix) :]: v for k, v in claims.details.items() if k.startswith(prefix)},
            )
        )
    return out


class CompositeVerifier:
    """A CPU verifier (SEV-SNP or TDX) that also verifies the GPUs attached to its evidence.

    Evidence without GPU collateral entries is the CPU's alone and verifies exactly as with
    ``cpu``. With them, every GPU report must verify to the NVIDIA root (``gpu``) and carry the
    nonce derived from the CPU report's data; any failure rejects the whole attestation."""

    def __init__(self, cpu: Verifier, gpu: Verifier) -> None:
        if cpu.tee not in CPU_TEES:
            raise ValueError(f"GPUs attach to SEV-SNP or TDX evidence, not {cpu.tee}")
        if gpu.tee is not Tee.NVIDIA_GPU:
            raise ValueError("the GPU verifier must be the NVIDIA one")
        self._cpu = cpu
        self._gpu = gpu

    @property
    def tee(self) -> Tee:
        return self._cpu.tee

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        cpu_collateral, gpus = split_collateral(collateral)
        cpu = self._cpu.verify(evidence, now=now, collateral=cpu_collateral)
        if not gpus:
            return cpu
        gpu_claims = []
        for i, g in enumerate(gpus):
            try:
                claims = self._gpu.verify(
                    g.evidence, now=now, collateral={COLLATERAL_CERT_CHAIN: g.cert_chain}
                )
            except (EvidenceFormatError, EvidenceVerificationError) as exc:
                raise type(exc)(exc.reason, f"gpu{i}: {exc.detail}") from exc
            expected = gpu_nonce(cpu.report_data, i, len(gpus))
            if not hmac.compare_digest(claims.report_data, expected):
                raise EvidenceVerificationError(
                    "gpu_binding_mismatch",
                    f"gpu{i}'s nonce is not derived from this CPU report's data "
                    f"(GPU {i} of {len(gpus)})",
                )
            gpu_claims.append(claims)
        return merge_claims(cpu, gpu_claims)


def attach_gpus(verifiers: Mapping[Tee, Verifier]) -> dict[Tee, Verifier]:
    """``verifiers`` with SEV-SNP and TDX wrapped so GPUs may attach to their evidence (when
    an NVIDIA verifier is configured); plain evidence verifies as before."""
    out = dict(verifiers)
    gpu = out.get(Tee.NVIDIA_GPU)
    if gpu is None:
        return out
    for tee in CPU_TEES:
        cpu = out.get(tee)
        if cpu is not None and not isinstance(cpu, CompositeVerifier):
            out[tee] = CompositeVerifier(cpu, gpu)
    return out
