"""Device collectors adapted to the agent's evidence-source seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from certs.errors import AttestmeshError
from sidecar.collectors import NitroSource, RawSource, TsmSource, device_source
from sidecar.tee.configfs_tsm import TsmReport
from tests.vectors import VECTORS

RD, NONCE, SPKI = b"\x01" * 64, b"\x02" * 32, b"\x03" * 91


class FakeTsm:
    def __init__(self, provider: str, auxblob: bytes | None = None) -> None:
        self.provider, self.auxblob, self.seen = provider, auxblob, b""

    def collect(self, report_data: bytes) -> TsmReport:
        self.seen = report_data
        return TsmReport(self.provider, b"evidence", self.auxblob, 1)


def cert_table(vlek_der: bytes) -> bytes:
    """GHCB certificate table: GUID, u32 offset, u32 length; all-zero terminator."""
    import struct
    import uuid

    vlek_guid = uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1").bytes
    header = 24 * 2
    return vlek_guid + struct.pack("<II", header, len(vlek_der)) + b"\0" * 24 + vlek_der


@pytest.mark.parametrize(("provider", "tee"), [("sev_guest", "sev-snp"), ("tdx_guest", "tdx")])
def test_tsm_maps_provider_to_tee(provider: str, tee: str) -> None:
    fake = FakeTsm(provider)
    ev = TsmSource(fake).collect(RD, nonce=NONCE, spki=SPKI)
    assert (ev.tee, ev.evidence, dict(ev.collateral), fake.seen) == (tee, b"evidence", {}, RD)


def test_tsm_snp_auxblob_certificates_become_collateral() -> None:
    vlek = (VECTORS / "sev-snp" / "milan_v3_vlek_aws_trustee" / "vlek.der").read_bytes()
    ev = TsmSource(FakeTsm("sev_guest", cert_table(vlek))).collect(RD, nonce=NONCE, spki=SPKI)
    assert ev.collateral == {"vlek": vlek}


def test_tsm_unknown_provider_is_refused() -> None:
    with pytest.raises(AttestmeshError) as exc:
        TsmSource(FakeTsm("arm_cca_guest")).collect(RD, nonce=NONCE, spki=SPKI)
    assert exc.value.reason == "tee_unsupported"


def test_nitro_puts_binding_nonce_and_key_in_their_fields() -> None:
    calls: list[tuple[bytes, bytes, bytes]] = []

    class FakeNsm:
        def collect(self, report_data: bytes, *, nonce: bytes, public_key: bytes) -> bytes:
            calls.append((report_data, nonce, public_key))
            return b"doc"

    ev = NitroSource(FakeNsm()).collect(RD, nonce=NONCE, spki=SPKI)
    assert (ev.tee, ev.evidence, calls) == ("nitro", b"doc", [(RD, NONCE, SPKI)])


def test_raw_source_tags_evidence() -> None:
    class FakeRaw:
        def collect(self, report_data: bytes) -> bytes:
            return report_data[:4]

    assert RawSource("sgx", FakeRaw()).collect(RD, nonce=NONCE, spki=SPKI).evidence == RD[:4]


def test_device_source_builds_every_kind(tmp_path: Path) -> None:
    for tee in ("tsm", "sev-snp", "nitro", "sgx"):
        assert device_source(tee, tmp_path / "dev") is not None
    with pytest.raises(AttestmeshError):
        device_source("quantum")
