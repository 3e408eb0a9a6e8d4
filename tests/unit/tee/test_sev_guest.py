"""/dev/sev-guest collector: pure encoding/decoding, and the ioctl path through a fake that
reads the request and writes the response through the addresses, as the kernel does."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.evidence.sev_snp import SevSnpVerifier, parse_report
from sidecar.tee.sev_guest import (
    REPORT_RESP_SIZE,
    SNP_GET_REPORT,
    SevGuestCollector,
    SevGuestDevice,
    SevGuestError,
    build_guest_request,
    build_report_request,
    iowr,
    parse_cert_table,
    parse_guest_request,
    parse_report_response,
)
from tests.vectors import VECTORS, pin

SNP = VECTORS / "sev-snp"
REPORT = (SNP / "milan_v2_gosevguest" / "report.bin").read_bytes()
REPORT_DATA = REPORT[0x50:0x90]


def _response(report: bytes = REPORT, status: int = 0, size: int = len(REPORT)) -> bytes:
    body = struct.pack("<II24x", status, size) + report
    return body + bytes(REPORT_RESP_SIZE - len(body))


def test_ioctl_number_matches_the_kernel_header() -> None:
    assert SNP_GET_REPORT == 0xC0205300
    assert iowr(ord("S"), 0x1, 32) == 0xC0205301  # SNP_GET_DERIVED_KEY


def test_report_request_layout() -> None:
    req = build_report_request(bytes(range(64)), vmpl=2)
    assert len(req) == 96
    assert req[:64] == bytes(range(64))
    assert struct.unpack_from("<I", req, 64) == (2,)
    assert req[68:] == bytes(28)
    with pytest.raises(ValueError):
        build_report_request(bytes(63))
    with pytest.raises(ValueError):
        build_report_request(bytes(64), vmpl=4)


def test_guest_request_layout_round_trips() -> None:
    raw = build_guest_request(0x1122334455667788, 0x99AABBCCDDEEFF00)
    assert len(raw) == 32
    assert raw[0] == 1 and raw[1:8] == bytes(7)  # msg_version, then padding to 8
    assert struct.unpack_from("<QQ", raw, 8) == (0x1122334455667788, 0x99AABBCCDDEEFF00)
    parsed = parse_guest_request(raw[:24] + struct.pack("<II", 0x16, 2))
    assert (parsed.msg_version, parsed.fw_error, parsed.vmm_error) == (1, 0x16, 2)
    with pytest.raises(ValueError):
        parse_guest_request(raw[:31])


def test_report_response_decoding() -> None:
    assert parse_report_response(_response()) == REPORT
    with pytest.raises(SevGuestError) as info:
        parse_report_response(_response(status=0x16))
    assert info.value.reason == "report_status"
    with pytest.raises(SevGuestError) as info:
        parse_report_response(_response(size=1000))
    assert info.value.reason == "report_response_invalid"
    with pytest.raises(SevGuestError) as info:
        parse_report_response(_response()[:100])
    assert info.value.reason == "report_response_invalid"


@dataclass
class FakeKernel:
    """Plays the sev-guest driver for one ioctl: checks the request, fills the response."""

    response: bytes = field(default_factory=_response)
    fail: list[tuple[int, int, int]] = field(default_factory=list)  # errno, fw_error, vmm_error
    seen: list[bytes] = field(default_factory=list)

    def __call__(self, fd: int, request: int, arg: bytearray) -> int:
        assert fd >= 0
        assert request == SNP_GET_REPORT
        assert isinstance(arg, bytearray) and len(arg) == 32
        call = parse_guest_request(arg)
        assert call.msg_version == 1
        self.seen.append(ctypes.string_at(call.req_addr, 96))
        if self.fail:
            err, fw, vmm = self.fail.pop(0)
            arg[24:32] = struct.pack("<II", fw, vmm)  # the driver copies exitinfo2 back
            raise OSError(err, "fake failure")
        ctypes.memmove(call.resp_addr, self.response, REPORT_RESP_SIZE)
        return 0


@pytest.fixture
def device_file(tmp_path: Path) -> Path:
    path = tmp_path / "sev-guest"
    path.write_bytes(b"")
    return path


def test_collect_through_the_ioctl_returns_a_verifiable_report(device_file: Path) -> None:
    kernel = FakeKernel()
    collector = SevGuestCollector(SevGuestDevice(device_file, ioctl=kernel))
    report = collector.collect(REPORT_DATA)
    assert report == REPORT
    assert kernel.seen == [build_report_request(REPORT_DATA)]
    assert parse_report(report).version == 2
    verifier = SevSnpVerifier([(SNP / "amd" / "ask_ark_milan.pem").read_bytes()])
    claims = verifier.verify(
        report,
        now=pin("2023-01-01T00:00:00Z"),
        collateral={"vcek": (SNP / "milan_v2_gosevguest" / "vcek.der").read_bytes()},
    )
    assert claims.report_data == REPORT_DATA


def test_vmpl_is_passed_to_the_firmware(device_file: Path) -> None:
    kernel = FakeKernel()
    SevGuestCollector(SevGuestDevice(device_file, ioctl=kernel), vmpl=1).collect(REPORT_DATA)
    assert struct.unpack_from("<I", kernel.seen[0], 64) == (1,)


def test_firmware_error_is_reported_with_codes(device_file: Path) -> None:
    kernel = FakeKernel(fail=[(errno.EIO, 0x16, 0)])
    collector = SevGuestCollector(SevGuestDevice(device_file, ioctl=kernel))
    with pytest.raises(SevGuestError) as info:
        collector.collect(REPORT_DATA)
    assert info.value.reason == "guest_request_failed"
    assert "fw_error 0x16" in info.value.detail


def test_throttled_request_is_retried(device_file: Path) -> None:
    sleeps: list[float] = []
    kernel = FakeKernel(fail=[(errno.EAGAIN, 0, 2), (errno.EIO, 0, 2)])
    device = SevGuestDevice(device_file, ioctl=kernel, retries=3, sleep=sleeps.append)
    assert SevGuestCollector(device).collect(REPORT_DATA) == REPORT
    assert len(kernel.seen) == 3
    assert sleeps == [0.1, 0.2]


def test_throttling_gives_up_after_retries(device_file: Path) -> None:
    kernel = FakeKernel(fail=[(errno.EAGAIN, 0, 2)] * 3)
    device = SevGuestDevice(device_file, ioctl=kernel, retries=2, sleep=lambda _s: None)
    with pytest.raises(SevGuestError) as info:
        SevGuestCollector(device).collect(REPORT_DATA)
    assert info.value.reason == "guest_request_failed"
    assert len(kernel.seen) == 3


def test_missing_device(tmp_path: Path) -> None:
    collector = SevGuestCollector(SevGuestDevice(tmp_path / "absent", ioctl=FakeKernel()))
    with pytest.raises(SevGuestError) as info:
        collector.collect(REPORT_DATA)
    assert info.value.reason == "device_unavailable"


def test_report_must_carry_the_requested_report_data(device_file: Path) -> None:
    collector = SevGuestCollector(SevGuestDevice(device_file, ioctl=FakeKernel()))
    with pytest.raises(SevGuestError) as info:
        collector.collect(bytes(64))
    assert info.value.reason == "report_data_mismatch"


def test_firmware_status_error_surfaces(device_file: Path) -> None:
    kernel = FakeKernel(response=_response(status=0x27))
    with pytest.raises(SevGuestError) as info:
        SevGuestCollector(SevGuestDevice(device_file, ioctl=kernel)).collect(REPORT_DATA)
    assert info.value.reason == "report_status"


# ---------------------------------------------------------------------------------------------
# certificate table (extended report / configfs-tsm auxblob)

GUID_VLEK = uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1")
GUID_ASK = uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782")
GUID_ARK = uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae")
GUID_OTHER = uuid.UUID("92f81bc3-5811-4d3d-97ff-d19f88dc67ea")


def _pem_to_der(pem: bytes) -> list[bytes]:
    blocks = pem.split(b"-----END CERTIFICATE-----")[:-1]
    return [
        base64.b64decode(b"".join(b.split(b"-----BEGIN CERTIFICATE-----")[1].split()))
        for b in blocks
    ]


def _table(entries: list[tuple[bytes, bytes]]) -> bytes:
    header_len = 24 * (len(entries) + 1)
    header, body = b"", b""
    for guid, blob in entries:
        header += guid + struct.pack("<II", header_len + len(body), len(blob))
        body += blob
    return header + bytes(24) + body


def test_cert_table_yields_verifiable_vlek_collateral() -> None:
    vlek = (SNP / "milan_v3_vlek_aws_trustee" / "vlek.der").read_bytes()
    chain_pem = (SNP / "amd" / "asvk_ark_milan_vlek.pem").read_bytes()
    asvk, ark = _pem_to_der(chain_pem)
    table = _table(
        [
            (GUID_VLEK.bytes, vlek),
            (GUID_OTHER.bytes, b"crl"),
            (GUID_ASK.bytes_le, asvk),  # either byte order is accepted
            (GUID_ARK.bytes, ark),
        ]
    )
    collateral = parse_cert_table(table)
    assert set(collateral) == {"vlek", "cert_chain"}
    assert collateral["vlek"] == vlek
    assert _pem_to_der(collateral["cert_chain"]) == [asvk, ark]
    verifier = SevSnpVerifier([chain_pem])
    report = (SNP / "milan_v3_vlek_aws_trustee" / "report.bin").read_bytes()
    claims = verifier.verify(report, now=pin("2025-05-28T00:00:00Z"), collateral=collateral)
    assert claims.details["signing_key"] == "vlek"


def test_empty_cert_table() -> None:
    assert parse_cert_table(bytes(24)) == {}


@pytest.mark.parametrize(
    "table",
    [
        b"",
        GUID_VLEK.bytes + struct.pack("<II", 48, 10),  # not terminated
        GUID_VLEK.bytes + struct.pack("<II", 48, 1000) + bytes(24) + b"x" * 10,  # past the end
        GUID_VLEK.bytes + struct.pack("<II", 0, 10) + bytes(24),  # overlaps the header
        (GUID_OTHER.bytes + struct.pack("<II", 65 * 24, 1)) * 65 + b"x",  # too many entries
    ],
)
def test_malformed_cert_table(table: bytes) -> None:
    with pytest.raises(SevGuestError) as info:
        parse_cert_table(table)
    assert info.value.reason == "cert_table_invalid"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_cert_table_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(SevGuestError):
        parse_cert_table(data)
