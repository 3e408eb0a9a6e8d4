"""Evidence sources for the agent: each real-device collector in ``sidecar/tee`` adapted to the
agent's ``EvidenceSource`` seam (report data in, TEE-tagged evidence + collateral out)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from certs.errors import AttestmeshError
from sidecar.agent import Evidence, EvidenceSource
from sidecar.tee.configfs_tsm import TsmReport
from sidecar.tee.sev_guest import parse_cert_table

# configfs-tsm provider names (the `provider` attribute) -> the attestmesh TEE wire name
TSM_PROVIDERS = {"sev_guest": "sev-snp", "tdx_guest": "tdx"}


class _Tsm(Protocol):
    def collect(self, report_data: bytes) -> TsmReport: ...


class _Raw(Protocol):
    def collect(self, report_data: bytes) -> bytes: ...


class _Nsm(Protocol):
    def collect(self, report_data: bytes, *, nonce: bytes, public_key: bytes) -> bytes: ...


class TsmSource:
    """SEV-SNP or TDX through configfs-tsm; SNP certificates from the auxblob become collateral."""

    def __init__(self, collector: _Tsm) -> None:
        self._collector = collector

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        report = self._collector.collect(report_data)
        tee = TSM_PROVIDERS.get(report.provider)
        if tee is None:
            raise AttestmeshError("tee_unsupported", f"configfs-tsm provider {report.provider!r}")
        collateral = parse_cert_table(report.auxblob) if tee == "sev-snp" and report.auxblob else {}
        return Evidence(tee, report.outblob, collateral)


class RawSource:
    """A collector that returns the evidence bytes only (/dev/sev-guest, Gramine)."""

    def __init__(self, tee: str, collector: _Raw) -> None:
        self._tee = tee
        self._collector = collector

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        return Evidence(self._tee, self._collector.collect(report_data))


class NitroSource:
    """Nitro: the binding goes in user_data; nonce and public key in their own fields too."""

    def __init__(self, collector: _Nsm) -> None:
        self._collector = collector

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        return Evidence("nitro", self._collector.collect(report_data, nonce=nonce, public_key=spki))


DEVICE_TEES = ("sev-snp", "tsm", "nitro", "sgx")


def device_source(tee: str, device: Path | None = None) -> EvidenceSource:
    """The evidence source for a real device; ``device`` overrides its default path."""
    if tee == "tsm":
        from sidecar.tee.configfs_tsm import ConfigfsTsmCollector

        return TsmSource(ConfigfsTsmCollector(device) if device else ConfigfsTsmCollector())
    if tee == "sev-snp":
        from sidecar.tee.sev_guest import SevGuestCollector, SevGuestDevice

        dev = SevGuestDevice(device) if device else None
        return RawSource("sev-snp", SevGuestCollector(dev))
    if tee == "nitro":
        from sidecar.tee.nitro_nsm import DevNsm, NsmCollector

        return NitroSource(NsmCollector(DevNsm(device) if device else None))
    if tee == "sgx":
        from sidecar.tee.gramine import GramineCollector

        return RawSource("sgx", GramineCollector(device) if device else GramineCollector())
    raise AttestmeshError("usage", f"no device evidence source for {tee!r}")
