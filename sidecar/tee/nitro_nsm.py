"""Evidence collector for AWS Nitro Enclaves: the Nitro Secure Module at ``/dev/nsm``.

Protocol (the NSM driver's raw interface): the request is a CBOR map, e.g.
``{"Attestation": {"user_data": bstr|null, "nonce": bstr|null, "public_key": bstr|null}}``,
passed to ``ioctl(fd, NSM_IOCTL_RAW, &msg)`` where ``msg`` is two iovecs ``{u64 addr, u64 len}``:
the request buffer, then a response buffer (the driver rewrites the response length). The
response is CBOR: ``{"Attestation": {"document": bstr}}`` on success, or ``{"Error": "<code>"}``
(e.g. ``InvalidArgument``, ``InputTooLarge``, ``BufferTooSmall``, ``InternalError``).

``build_attestation_request`` and ``parse_attestation_response`` are pure; the ioctl is behind a
tiny seam (``Ioctl``) so tests exercise the whole path with a fake device.
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import cbor2

from certs.errors import AttestmeshError

NSM_DEVICE = Path("/dev/nsm")
NSM_MAGIC = 0x0A
NSM_REQUEST_MAX = 0x1000
NSM_RESPONSE_MAX = 0x3000
MAX_FIELD = 1024  # the NSM limit for user_data, nonce and public_key
_IOVEC = struct.Struct("=QQ")
_MESSAGE_SIZE = 2 * _IOVEC.size


def _iowr(kind: int, number: int, size: int) -> int:
    read_write = 3  # _IOC_READ | _IOC_WRITE
    return (read_write << 30) | (size << 16) | (kind << 8) | number


NSM_IOCTL_RAW = _iowr(NSM_MAGIC, 0, _MESSAGE_SIZE)  # 0xC0200A00

# NSM error codes -> bounded reason vocabulary.
NSM_ERROR_REASONS = {
    "InvalidArgument": "nsm_invalid_argument",
    "InvalidIndex": "nsm_invalid_index",
    "InvalidResponse": "nsm_invalid_response",
    "ReadOnlyIndex": "nsm_read_only_index",
    "InvalidOperation": "nsm_invalid_operation",
    "BufferTooSmall": "nsm_buffer_too_small",
    "InputTooLarge": "nsm_input_too_large",
    "InternalError": "nsm_internal_error",
}


class NsmError(AttestmeshError):
    """The NSM refused or failed a request (``reason`` is ``nsm_<code>`` or a local code)."""


Ioctl = Callable[[int, int, bytearray], int]
"""``ioctl(fd, request, buffer)`` mutating ``buffer`` in place (``fcntl.ioctl`` shape)."""


def _system_ioctl(fd: int, request: int, buffer: bytearray) -> int:
    result: int = fcntl.ioctl(fd, request, buffer, True)
    return result


def _checked(name: str, value: bytes | None) -> bytes | None:
    if value is not None and len(value) > MAX_FIELD:
        raise NsmError("nsm_input_too_large", f"{name} is {len(value)} bytes (max {MAX_FIELD})")
    return value


def build_attestation_request(
    *, user_data: bytes | None, nonce: bytes | None, public_key: bytes | None
) -> bytes:
    """The CBOR ``Attestation`` request."""
    request = cbor2.dumps(
        {
            "Attestation": {
                "user_data": _checked("user_data", user_data),
                "nonce": _checked("nonce", nonce),
                "public_key": _checked("public_key", public_key),
            }
        }
    )
    if len(request) > NSM_REQUEST_MAX:
        raise NsmError("nsm_input_too_large", f"request is {len(request)} bytes")
    return bytes(request)


def parse_attestation_response(data: bytes) -> bytes:
    """The attestation document from an NSM response; NsmError on an error or a bad response."""
    fp = io.BytesIO(data)
    try:
        value: Any = cbor2.CBORDecoder(fp, max_depth=4, allow_indefinite=False).decode()
    except Exception as exc:  # cbor2 raises several types; translate them all
        raise NsmError("nsm_invalid_response", f"not CBOR: {type(exc).__name__}") from None
    if fp.tell() != len(data) or not isinstance(value, dict) or len(value) != 1:
        raise NsmError("nsm_invalid_response", "expected a one-entry map")
    if "Error" in value:
        code = value["Error"]
        code = code[:64] if isinstance(code, str) else repr(code)[:64]
        raise NsmError(NSM_ERROR_REASONS.get(code, "nsm_error"), f"NSM returned error {code}")
    body = value.get("Attestation")
    document = body.get("document") if isinstance(body, dict) else None
    if not isinstance(document, bytes) or not document:
        raise NsmError("nsm_invalid_response", "no attestation document in the response")
    return document


class NsmDevice(Protocol):
    def exchange(self, request: bytes) -> bytes:
        """Send one raw request, return the raw response."""
        ...


class DevNsm:
    """``/dev/nsm`` through the raw ioctl. ``ioctl`` and ``opener`` are seams for tests."""

    def __init__(
        self,
        path: Path = NSM_DEVICE,
        *,
        ioctl: Ioctl = _system_ioctl,
        opener: Callable[[Path], int] | None = None,
    ) -> None:
        self._path = path
        self._ioctl = ioctl
        self._open = opener or (lambda p: os.open(p, os.O_RDWR | os.O_CLOEXEC))

    def exchange(self, request: bytes) -> bytes:
        if len(request) > NSM_REQUEST_MAX:
            raise NsmError("nsm_input_too_large", f"request is {len(request)} bytes")
        req_buf = ctypes.create_string_buffer(request, len(request))
        resp_buf = ctypes.create_string_buffer(NSM_RESPONSE_MAX)
        message = bytearray(
            _IOVEC.pack(ctypes.addressof(req_buf), len(request))
            + _IOVEC.pack(ctypes.addressof(resp_buf), NSM_RESPONSE_MAX)
        )
        try:
            fd = self._open(self._path)
        except OSError as exc:
            raise NsmError("nsm_unavailable", f"{self._path}: {exc.strerror or exc}") from None
        try:
            self._ioctl(fd, NSM_IOCTL_RAW, message)
        except OSError as exc:
            raise NsmError("nsm_ioctl_failed", f"{self._path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        _, length = _IOVEC.unpack_from(message, _IOVEC.size)
        if not 0 < length <= NSM_RESPONSE_MAX:
            raise NsmError("nsm_invalid_response", f"response length {length}")
        return resp_buf.raw[:length]


class NsmCollector:
    """Collects Nitro attestation documents carrying the key binding.

    ``report_data`` goes to ``user_data`` (what the control plane compares with the binding);
    ``nonce`` and ``public_key`` are also placed in their own document fields.
    """

    def __init__(self, device: NsmDevice | None = None) -> None:
        self._device = device or DevNsm()

    def collect(self, report_data: bytes, *, nonce: bytes, public_key: bytes) -> bytes:
        request = build_attestation_request(
            user_data=report_data, nonce=nonce, public_key=public_key
        )
        return parse_attestation_response(self._device.exchange(request))
