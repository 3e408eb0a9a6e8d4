"""Normalised claims: the facts a verifier extracted from authentic evidence.

Verifiers return facts, never decisions; ``certs.policy.appraise`` decides.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol


class Tee(enum.StrEnum):
    SIM = "sim"
    NITRO = "nitro"
    SEV_SNP = "sev-snp"
    TDX = "tdx"
    SGX = "sgx"
    NVIDIA_GPU = "nvidia-gpu"


class TcbStatus(enum.StrEnum):
    """Intel's TCB status vocabulary (also used by policies to accept statuses)."""

    UP_TO_DATE = "UpToDate"
    SW_HARDENING_NEEDED = "SWHardeningNeeded"
    CONFIGURATION_NEEDED = "ConfigurationNeeded"
    CONFIGURATION_AND_SW_HARDENING_NEEDED = "ConfigurationAndSWHardeningNeeded"
    OUT_OF_DATE = "OutOfDate"
    OUT_OF_DATE_CONFIGURATION_NEEDED = "OutOfDateConfigurationNeeded"
    REVOKED = "Revoked"


Detail = str | int | bool


@dataclass(frozen=True, slots=True)
class Claims:
    """What authentic evidence says about a workload.

    ``measurements`` uses well-known lowercase keys per TEE with lowercase hex values:
    sim ``measurement``; nitro ``pcr0``..``pcr15`` (only those present); sev-snp ``measurement``,
    ``host_data``, ``id_key_digest``, ``author_key_digest``, ``family_id``, ``image_id``;
    tdx ``mrtd``, ``rtmr0``..``rtmr3``, ``mrseam``, ``mrsignerseam``, ``mrconfigid``, ``mrowner``,
    ``mrownerconfig`` (and ``mrservicetd`` for TDX 1.5); sgx ``mrenclave``, ``mrsigner``;
    nvidia-gpu ``measurement_<index>``.

    ``report_data`` is the field that carries the key binding (64 bytes where the TEE has them;
    Nitro: ``user_data``). ``tcb`` holds numeric TCB components (e.g. SNP ``bootloader``, ``tee``,
    ``snp``, ``microcode``; Intel ``pce_svn``...). ``details`` holds TEE-specific audit facts
    (guest policy bits, versions, timestamps) as plain scalars.
    """

    tee: Tee
    measurements: Mapping[str, str]
    report_data: bytes
    debug: bool
    evidence_sha256: str
    signer: str | None = None
    product_id: int | None = None
    svn: int | None = None
    platform_id: str | None = None
    tcb: Mapping[str, int] = field(default_factory=dict)
    tcb_status: str | None = None
    advisories: tuple[str, ...] = ()
    details: Mapping[str, Detail] = field(default_factory=dict)


def evidence_digest(evidence: bytes) -> str:
    return hashlib.sha256(evidence).hexdigest()


Collateral = Mapping[str, bytes]
"""Named collateral blobs (e.g. ``vcek``, ``tcb_info``); each verifier documents its names."""


class Verifier(Protocol):
    """One TEE's verifier: pure, time injected, trust anchors given at construction."""

    @property
    def tee(self) -> Tee: ...

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        """Return claims for authentic evidence or raise EvidenceFormatError /
        EvidenceVerificationError with a precise reason."""
        ...
