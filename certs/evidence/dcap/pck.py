"""The PCK certificate's SGX extension (OID 1.2.840.113741.1.13.1): PPID, TCB components,
PCESVN, CPUSVN, PCEID, FMSPC, SGX type. Read with the shared DER helpers; any malformation is
``pck_extension_invalid``."""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509

from certs.errors import EvidenceVerificationError
from certs.evidence.x509chain import (
    TAG_OID,
    TAG_SEQUENCE,
    ParsedCertificate,
    der_items,
    der_single,
    der_uint,
)

_SGX_EXT_OID = x509.ObjectIdentifier("1.2.840.113741.1.13.1")
_SGX_EXT_PREFIX = bytes.fromhex("2a864886f84d010d01")  # DER body of 1.2.840.113741.1.13.1


@dataclass(frozen=True, slots=True)
class PckExtension:
    ppid: bytes
    cpu_svn_components: tuple[int, ...]
    pce_svn: int
    cpu_svn: bytes
    pce_id: bytes
    fmspc: bytes
    sgx_type: int | None


def parse_pck_extension(cert: ParsedCertificate) -> PckExtension:
    """Read PPID, TCB (16 SGX components, PCESVN, CPUSVN), PCEID, FMSPC from OID ...13.1."""
    raw = cert.raw_extension(_SGX_EXT_OID)
    if raw is None:
        raise EvidenceVerificationError("pck_extension_invalid", "no SGX extension")
    try:
        entries = _sgx_entries(der_single(raw, TAG_SEQUENCE))
        tcb_entries = _sgx_entries(entries[2][1])
        components = tuple(der_uint(tcb_entries[i][1]) for i in range(1, 17) if tcb_entries.get(i))
        pce_svn = der_uint(tcb_entries[17][1])
        cpu_svn = tcb_entries[18][1]
        ppid, pce_id, fmspc = entries[1][1], entries[3][1], entries[4][1]
        sgx_type = der_uint(entries[5][1]) if 5 in entries else None
    except (ValueError, KeyError, IndexError) as exc:
        raise EvidenceVerificationError("pck_extension_invalid", str(exc)) from exc
    if len(components) != 16 or len(cpu_svn) != 16 or len(fmspc) != 6 or len(pce_id) != 2:
        raise EvidenceVerificationError("pck_extension_invalid", "wrong field sizes")
    return PckExtension(ppid, components, pce_svn, cpu_svn, pce_id, fmspc, sgx_type)


def _sgx_entries(seq_content: bytes) -> dict[int, tuple[int, bytes]]:
    """SEQUENCE OF SEQUENCE {OID, value} -> {last OID arc: (value tag, value)} for our arcs."""
    out: dict[int, tuple[int, bytes]] = {}
    for tag, content in der_items(seq_content):
        if tag != TAG_SEQUENCE:
            raise ValueError("entry is not a SEQUENCE")
        parts = der_items(content)
        if len(parts) != 2 or parts[0][0] != TAG_OID:
            raise ValueError("entry is not {OID, value}")
        oid = parts[0][1]
        if not oid.startswith(_SGX_EXT_PREFIX) or len(oid) <= len(_SGX_EXT_PREFIX):
            raise ValueError("foreign OID in SGX extension")
        out[oid[-1]] = parts[1]
        if parts[1][0] == TAG_SEQUENCE:
            out[oid[-1]] = (TAG_SEQUENCE, parts[1][1])
    return out
