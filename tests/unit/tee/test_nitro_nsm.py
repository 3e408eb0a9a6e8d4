from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from pathlib import Path

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.evidence.nitro import looks_like
from sidecar.tee import nitro_nsm
from sidecar.tee.nitro_nsm import (
    NSM_IOCTL_RAW,
    DevNsm,
    NsmCollector,
    NsmError,
    build_attestation_request,
    parse_attestation_response,
)
from tests.vectors import VECTORS

DOCUMENT = (VECTORS / "nitro" / "veracruz_eu-west-1_20221109.cbor").read_bytes()


def test_ioctl_number_is_iowr_0x0a_0_of_two_iovecs() -> None:
    assert NSM_IOCTL_RAW == 0xC0200A00


def test_request_encoding() -> None:
    request = build_attestation_request(user_data=b"u" * 64, nonce=b"n" * 32, public_key=None)
    assert cbor2.loads(request) == {
        "Attestation": {"user_data": b"u" * 64, "nonce": b"n" * 32, "public_key": None}
    }
    with pytest.raises(NsmError) as err:
        build_attestation_request(user_data=bytes(1025), nonce=None, public_key=None)
    assert err.value.reason == "nsm_input_too_large"


def test_response_decoding() -> None:
    ok = cbor2.dumps({"Attestation": {"document": DOCUMENT}})
    assert parse_attestation_response(ok) == DOCUMENT
    for code, reason in [
        ("InputTooLarge", "nsm_input_too_large"),
        ("InternalError", "nsm_internal_error"),
        ("Surprising", "nsm_error"),
    ]:
        with pytest.raises(NsmError) as err:
            parse_attestation_response(cbor2.dumps({"Error": code}))
        assert err.value.reason == reason
    for bad in [
        b"",
        b"\xff",
        ok + b"\x00",
        cbor2.dumps({"Attestation": {}}),
        cbor2.dumps({"Attestation": {"document": ""}}),
        cbor2.dumps([1, 2]),
    ]:
        with pytest.raises(NsmError) as err:
            parse_attestation_response(bad)
        assert err.value.reason == "nsm_invalid_response"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_response_decoding_raises_only_nsm_errors(data: bytes) -> None:
    with contextlib.suppress(NsmError):
        parse_attestation_response(data)


class FakeNsmDriver:
    """Behaves like the kernel driver: reads the request and writes the response through the
    iovec addresses in the message, and rewrites the response length."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.requests: list[bytes] = []
        self.calls: list[tuple[int, int]] = []

    def __call__(self, fd: int, request: int, message: bytearray) -> int:
        self.calls.append((fd, request))
        assert len(message) == 32
        req_addr, req_len, resp_addr, resp_cap = struct.unpack("=QQQQ", message)
        self.requests.append(ctypes.string_at(req_addr, req_len))
        assert len(self.reply) <= resp_cap
        ctypes.memmove(resp_addr, self.reply, len(self.reply))
        struct.pack_into("=Q", message, 24, len(self.reply))
        return 0


@pytest.fixture
def fake_device(tmp_path: Path) -> Path:
    path = tmp_path / "nsm"
    path.write_bytes(b"")
    return path


def test_collector_round_trip_through_the_ioctl_seam(fake_device: Path) -> None:
    driver = FakeNsmDriver(cbor2.dumps({"Attestation": {"document": DOCUMENT}}))
    collector = NsmCollector(DevNsm(fake_device, ioctl=driver))
    report_data = bytes(range(64))
    document = collector.collect(report_data, nonce=b"\x01" * 32, public_key=b"spki")
    assert document == DOCUMENT
    assert looks_like(document)
    assert driver.calls[0][1] == NSM_IOCTL_RAW
    assert cbor2.loads(driver.requests[0]) == {
        "Attestation": {"user_data": report_data, "nonce": b"\x01" * 32, "public_key": b"spki"}
    }


def test_device_error_reply_is_raised(fake_device: Path) -> None:
    driver = FakeNsmDriver(cbor2.dumps({"Error": "InvalidArgument"}))
    with pytest.raises(NsmError) as err:
        NsmCollector(DevNsm(fake_device, ioctl=driver)).collect(
            bytes(64), nonce=bytes(32), public_key=b"k"
        )
    assert err.value.reason == "nsm_invalid_argument"


def test_missing_device_and_failing_ioctl(tmp_path: Path, fake_device: Path) -> None:
    with pytest.raises(NsmError) as missing:
        DevNsm(tmp_path / "absent").exchange(b"\xa0")
    assert missing.value.reason == "nsm_unavailable"

    def failing(fd: int, request: int, message: bytearray) -> int:
        raise OSError(25, os.strerror(25))

    with pytest.raises(NsmError) as failed:
        DevNsm(fake_device, ioctl=failing).exchange(b"\xa0")
    assert failed.value.reason == "nsm_ioctl_failed"


def test_driver_reporting_a_bad_length(fake_device: Path) -> None:
    def zero_length(fd: int, request: int, message: bytearray) -> int:
        struct.pack_into("=Q", message, 24, 0)
        return 0

    with pytest.raises(NsmError) as err:
        DevNsm(fake_device, ioctl=zero_length).exchange(b"\xa0")
    assert err.value.reason == "nsm_invalid_response"


def test_oversized_request_is_refused_before_the_device(fake_device: Path) -> None:
    with pytest.raises(NsmError) as err:
        DevNsm(fake_device, ioctl=FakeNsmDriver(b"")).exchange(bytes(nitro_nsm.NSM_REQUEST_MAX + 1))
    assert err.value.reason == "nsm_input_too_large"


def test_real_ioctl_on_a_non_device_fails_cleanly(fake_device: Path) -> None:
    # The production ioctl path on a regular file: the kernel answers ENOTTY.
    with pytest.raises(NsmError) as err:
        DevNsm(fake_device).exchange(b"\xa0")
    assert err.value.reason == "nsm_ioctl_failed"
