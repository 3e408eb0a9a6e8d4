"""SEV-SNP evidence from ``/dev/sev-guest`` (the ``SNP_GET_REPORT`` ioctl).

Linux uapi (``include/uapi/linux/sev-guest.h``), x86-64 layout:

- ``struct snp_report_req`` (96 bytes): ``u8 user_data[64]; u32 vmpl; u8 rsvd[28]``.
- ``struct snp_report_resp`` (4000 bytes): the firmware's MSG_REPORT_RSP: ``u32 status;
  u32 report_size; u8 reserved[24];`` then the 1184-byte ATTESTATION_REPORT at offset 32.
- ``struct snp_guest_request_ioctl`` (32 bytes): ``u8 msg_version`` (7 bytes padding),
  ``u64 req_data`` and ``u64 resp_data`` (user addresses), ``u64 exitinfo2`` =
  ``u32 fw_error`` + ``u32 vmm_error``.
- ``SNP_GET_REPORT = _IOWR('S', 0x0, struct snp_guest_request_ioctl)`` = ``0xC0205300``.

The encoding and decoding are pure functions; the ioctl itself sits behind the ``Ioctl`` seam
(``fcntl.ioctl`` in production, a fake in tests that reads and writes through the addresses).
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import os
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from certs.errors import AttestmeshError

__all__ = [
    "DEFAULT_DEVICE",
    "REPORT_RESP_SIZE",
    "SNP_GET_REPORT",
    "GuestRequestResult",
    "ReportDevice",
    "SevGuestCollector",
    "SevGuestDevice",
    "SevGuestError",
    "build_guest_request",
    "build_report_request",
    "iowr",
    "parse_cert_table",
    "parse_guest_request",
    "parse_report_response",
]

DEFAULT_DEVICE: Final = Path("/dev/sev-guest")
REPORT_DATA_LEN: Final = 64
REPORT_SIZE: Final = 1184
REPORT_REQ_SIZE: Final = 96
REPORT_RESP_SIZE: Final = 4000
REPORT_RESP_HEADER: Final = 32
GUEST_REQUEST_SIZE: Final = 32
MSG_VERSION: Final = 1
VMM_ERR_BUSY: Final = 2  # SNP_GUEST_VMM_ERR_BUSY: the host throttled the request

_REPORT_REQ = struct.Struct("<64sI28x")
_GUEST_REQ = struct.Struct("<B7xQQII")
_RESP_HEAD = struct.Struct("<II24x")


class SevGuestError(AttestmeshError):
    """The guest could not obtain a report (reason: ``device_unavailable``,
    ``guest_request_failed``, ``report_status``, ``report_response_invalid``,
    ``report_data_mismatch``)."""


def iowr(ioc_type: int, nr: int, size: int) -> int:
    """Linux ``_IOWR(type, nr, size)`` for x86-64 (dir bits: read|write = 3)."""
    return (3 << 30) | (size << 16) | (ioc_type << 8) | nr


SNP_GET_REPORT: Final = iowr(ord("S"), 0x0, GUEST_REQUEST_SIZE)


def build_report_request(report_data: bytes, vmpl: int = 0) -> bytes:
    if len(report_data) != REPORT_DATA_LEN:
        raise ValueError(f"report_data must be {REPORT_DATA_LEN} bytes, got {len(report_data)}")
    if not 0 <= vmpl <= 3:
        raise ValueError(f"vmpl must be 0..3, got {vmpl}")
    return _REPORT_REQ.pack(report_data, vmpl)


def build_guest_request(req_addr: int, resp_addr: int, msg_version: int = MSG_VERSION) -> bytes:
    return _GUEST_REQ.pack(msg_version, req_addr, resp_addr, 0, 0)


@dataclass(frozen=True, slots=True)
class GuestRequestResult:
    msg_version: int
    req_addr: int
    resp_addr: int
    fw_error: int
    vmm_error: int


def parse_guest_request(data: bytes | bytearray) -> GuestRequestResult:
    if len(data) != GUEST_REQUEST_SIZE:
        raise ValueError(f"snp_guest_request_ioctl is {GUEST_REQUEST_SIZE} bytes")
    return GuestRequestResult(*_GUEST_REQ.unpack(bytes(data)))


def parse_report_response(data: bytes) -> bytes:
    """Return the report from a ``snp_report_resp`` buffer, checking status and size."""
    if len(data) < REPORT_RESP_HEADER + REPORT_SIZE:
        raise SevGuestError("report_response_invalid", f"response is {len(data)} bytes")
    status, size = _RESP_HEAD.unpack_from(data, 0)
    if status != 0:
        raise SevGuestError("report_status", f"firmware status {status:#x}")
    if size != REPORT_SIZE:
        raise SevGuestError("report_response_invalid", f"report_size {size}, want {REPORT_SIZE}")
    return bytes(data[REPORT_RESP_HEADER : REPORT_RESP_HEADER + REPORT_SIZE])


Ioctl = Callable[[int, int, bytearray], object]
"""``ioctl(fd, request, arg)`` mutating ``arg`` in place (``fcntl.ioctl(fd, req, arg, True)``)."""


def _fcntl_ioctl(fd: int, request: int, arg: bytearray) -> object:
    return fcntl.ioctl(fd, request, arg, True)


class ReportDevice(Protocol):
    """The seam above the ioctl: one SNP_GET_REPORT round trip."""

    def get_report(self, request: bytes) -> bytes:
        """Send a 96-byte snp_report_req; return the 4000-byte snp_report_resp."""
        ...


class SevGuestDevice:
    """The real ``/dev/sev-guest``: marshals buffers and calls the ioctl."""

    def __init__(
        self,
        path: Path = DEFAULT_DEVICE,
        *,
        ioctl: Ioctl = _fcntl_ioctl,
        retries: int = 3,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._path = path
        self._ioctl = ioctl
        self._retries = retries
        self._sleep = sleep

    def get_report(self, request: bytes) -> bytes:
        if len(request) != REPORT_REQ_SIZE:
            raise ValueError(f"snp_report_req is {REPORT_REQ_SIZE} bytes")
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SevGuestError("device_unavailable", f"{self._path}: {exc}") from exc
        try:
            for attempt in range(self._retries + 1):
                req = ctypes.create_string_buffer(request, REPORT_REQ_SIZE)
                resp = ctypes.create_string_buffer(REPORT_RESP_SIZE)
                arg = bytearray(build_guest_request(ctypes.addressof(req), ctypes.addressof(resp)))
                try:
                    self._ioctl(fd, SNP_GET_REPORT, arg)
                except OSError as exc:
                    result = parse_guest_request(arg)
                    busy = exc.errno == errno.EAGAIN or result.vmm_error == VMM_ERR_BUSY
                    if busy and attempt < self._retries:
                        self._sleep(0.1 * (attempt + 1))
                        continue
                    raise SevGuestError(
                        "guest_request_failed",
                        f"SNP_GET_REPORT: {exc.strerror or exc} "
                        f"(fw_error {result.fw_error:#x}, vmm_error {result.vmm_error:#x})",
                    ) from exc
                return resp.raw
            raise SevGuestError("guest_request_failed", "SNP_GET_REPORT: host kept throttling")
        finally:
            os.close(fd)


class SevGuestCollector:
    """Collect an SNP attestation report carrying ``report_data``."""

    def __init__(self, device: ReportDevice | None = None, *, vmpl: int = 0) -> None:
        self._device = device if device is not None else SevGuestDevice()
        self._vmpl = vmpl

    def collect(self, report_data: bytes) -> bytes:
        """Return the raw 1184-byte report (the evidence the control plane verifies)."""
        response = self._device.get_report(build_report_request(report_data, self._vmpl))
        report = parse_report_response(response)
        if report[0x50:0x90] != report_data:
            raise SevGuestError("report_data_mismatch", "report does not carry our report_data")
        return report


# ---------------------------------------------------------------------------------------------
# the extended report's certificate table (configfs-tsm ``auxblob`` for sev_guest)

_CERT_GUIDS: Final = {
    uuid.UUID("63da758d-e664-4564-adc5-f4b93be8accd"): "vcek",
    uuid.UUID("a8074bc2-a25a-483e-aae6-39c045a0b8a1"): "vlek",
    uuid.UUID("4ab7b379-bbac-4fe4-a02f-05aef327c782"): "ask",
    uuid.UUID("c0b406a4-a803-4952-9743-3fb6014cd0ae"): "ark",
}
_CERT_ENTRY = struct.Struct("<16sII")
_MAX_CERT_ENTRIES: Final = 64


def _pem(der: bytes) -> bytes:
    b64 = base64.b64encode(der)
    body = b"\n".join(b64[i : i + 64] for i in range(0, len(b64), 64))
    return b"-----BEGIN CERTIFICATE-----\n" + body + b"\n-----END CERTIFICATE-----\n"


def parse_cert_table(table: bytes) -> dict[str, bytes]:
    """Turn the host's certificate table (GHCB spec: entries of GUID, u32 offset, u32 length,
    ended by an all-zero entry) into SNP collateral: ``vcek``/``vlek`` (DER) and
    ``cert_chain`` (PEM, ASK or ASVK then ARK) when both are present. Unknown GUIDs are
    ignored. GUIDs are accepted in either byte order (the text order is what Linux uses)."""
    found: dict[str, bytes] = {}
    for index in range(_MAX_CERT_ENTRIES):
        at = index * _CERT_ENTRY.size
        if at + _CERT_ENTRY.size > len(table):
            raise SevGuestError("cert_table_invalid", "table is not terminated")
        raw_guid, offset, length = _CERT_ENTRY.unpack_from(table, at)
        if raw_guid == bytes(16):
            break
        name = _CERT_GUIDS.get(uuid.UUID(bytes=raw_guid)) or _CERT_GUIDS.get(
            uuid.UUID(bytes_le=raw_guid)
        )
        if length == 0 or offset + length > len(table) or offset < at + _CERT_ENTRY.size:
            raise SevGuestError("cert_table_invalid", f"entry {index} points outside the table")
        if name is not None:
            found[name] = table[offset : offset + length]
    else:
        raise SevGuestError("cert_table_invalid", f"more than {_MAX_CERT_ENTRIES} entries")
    out = {k: v for k, v in found.items() if k in ("vcek", "vlek")}
    if "ask" in found and "ark" in found:
        out["cert_chain"] = _pem(found["ask"]) + _pem(found["ark"])
    return out
