"""Cheap decoding of the two xDS request messages (no pydantic, no message tree).

An ACK is the request a server receives most (one per response per stream); betterproto2's
``parse`` validates a pydantic dataclass per message. :func:`decode_sotw` and
:func:`decode_delta` read only the fields the sessions use into slotted objects with the same
attribute names as ``DiscoveryRequest`` / ``DeltaDiscoveryRequest``, skip every other field
by its wire type, and raise :class:`WireError` on malformed input (truncated, bad wire type,
invalid UTF-8). Tested against betterproto2's encoding of random messages.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "MAX_FIELDS",
    "DeltaRequest",
    "ErrorDetail",
    "NodeRef",
    "SotwRequest",
    "WireError",
    "decode_delta",
    "decode_sotw",
]


MAX_FIELDS = 100_000
"""Most fields one message (or nested message) may have, resource names and initial versions
included: a 4 MiB message of empty fields would otherwise be two million of them, seconds of
the event loop (and, as names, two million strings)."""


class WireError(ValueError):
    """The bytes are not a valid protobuf message of the expected shape."""


class NodeRef:
    __slots__ = ("id",)

    def __init__(self, node_id: str) -> None:
        self.id = node_id


class ErrorDetail:
    """``google.rpc.Status``: what a NACK says."""

    __slots__ = ("code", "message")

    def __init__(self, code: int = 0, message: str = "") -> None:
        self.code = code
        self.message = message


class SotwRequest:
    """The fields of a ``DiscoveryRequest`` the server reads."""

    __slots__ = (
        "error_detail",
        "node",
        "resource_names",
        "response_nonce",
        "type_url",
        "version_info",
    )

    def __init__(self) -> None:
        self.version_info = ""
        self.node: NodeRef | None = None
        self.resource_names: list[str] = []
        self.type_url = ""
        self.response_nonce = ""
        self.error_detail: ErrorDetail | None = None


class DeltaRequest:
    """The fields of a ``DeltaDiscoveryRequest`` the server reads."""

    __slots__ = (
        "error_detail",
        "initial_resource_versions",
        "node",
        "resource_names_subscribe",
        "resource_names_unsubscribe",
        "response_nonce",
        "type_url",
    )

    def __init__(self) -> None:
        self.node: NodeRef | None = None
        self.type_url = ""
        self.resource_names_subscribe: list[str] = []
        self.resource_names_unsubscribe: list[str] = []
        self.initial_resource_versions: dict[str, str] = {}
        self.response_nonce = ""
        self.error_detail: ErrorDetail | None = None


def _varint(buf: bytes, i: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes, i: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, value or start, end (-1 for a varint), wire type) of each field, one at
    a time (a list of them would cost ~100 bytes per 2-byte field of the message); more than
    :data:`MAX_FIELDS` is a :class:`WireError`."""
    left = MAX_FIELDS
    while i < end:
        if not left:
            raise WireError(f"more than {MAX_FIELDS} fields in one message")
        left -= 1
        key, i = _varint(buf, i, end)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise WireError("field number 0")
        if wt == 0:
            v, i = _varint(buf, i, end)
            yield num, v, -1, 0
        elif wt == 2:
            n, i = _varint(buf, i, end)
            if i + n > end:
                raise WireError("truncated length-delimited field")
            yield num, i, i + n, 2
            i += n
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise WireError(f"unsupported wire type {wt}")
        if i > end:
            raise WireError("truncated fixed-width field")


def _str(buf: bytes, start: int, end: int) -> str:
    try:
        return buf[start:end].decode()
    except UnicodeDecodeError as exc:
        raise WireError("a string field is not UTF-8") from exc


def _node(buf: bytes, start: int, end: int) -> NodeRef:
    node_id = ""
    for num, a, b, wt in _fields(buf, start, end):
        if num == 1 and wt == 2:
            node_id = _str(buf, a, b)
    return NodeRef(node_id)


def _status(buf: bytes, start: int, end: int) -> ErrorDetail:
    detail = ErrorDetail()
    for num, a, b, wt in _fields(buf, start, end):
        if num == 1 and wt == 0:
            code = a & 0xFFFF_FFFF  # int32: the low 32 bits (a varint may hold up to 70)
            detail.code = code - (1 << 32) if code >= 1 << 31 else code
        elif num == 2 and wt == 2:
            detail.message = _str(buf, a, b)
    return detail


def _check(wt: int, want: int, num: int) -> None:
    if wt != want:
        raise WireError(f"field {num} has wire type {wt}, expected {want}")


def decode_sotw(data: bytes) -> SotwRequest:
    req = SotwRequest()
    for num, a, b, wt in _fields(data, 0, len(data)):
        if num == 1:
            _check(wt, 2, num)
            req.version_info = _str(data, a, b)
        elif num == 2:
            _check(wt, 2, num)
            req.node = _node(data, a, b)
        elif num == 3:
            _check(wt, 2, num)
            req.resource_names.append(_str(data, a, b))
        elif num == 4:
            _check(wt, 2, num)
            req.type_url = _str(data, a, b)
        elif num == 5:
            _check(wt, 2, num)
            req.response_nonce = _str(data, a, b)
        elif num == 6:
            _check(wt, 2, num)
            req.error_detail = _status(data, a, b)
    return req


_ACKS_KEPT = 256
_acks: dict[bytes, DeltaRequest] = {}
"""ACKs decoded lately, by their bytes: the streams sent one change share its nonce (see
xds.server), so thousands of streams send the very same ACK; the decoded request is shared
(the sessions only read requests). Cleared when full."""


def decode_delta(data: bytes) -> DeltaRequest:
    # the request a server receives most, an ACK: type_url (2) then response_nonce (6), each
    # shorter than 128 bytes, and nothing else (no node: sent on a stream's first request)
    if type(data) is bytes:
        hit = _acks.get(data)
        if hit is not None:
            return hit
    end = len(data)
    if end >= 4 and data[0] == 0x12:
        a = data[1]
        if (
            a < 0x80
            and 4 + a <= end
            and data[2 + a] == 0x32
            and data[3 + a] < 0x80
            and 4 + a + data[3 + a] == end
        ):
            req = DeltaRequest()
            req.type_url = _str(data, 2, 2 + a)
            req.response_nonce = _str(data, 4 + a, end)
            if type(data) is bytes:
                if len(_acks) >= _ACKS_KEPT:
                    _acks.clear()
                _acks[data] = req
            return req
    return _decode_delta(data)


def _decode_delta(data: bytes) -> DeltaRequest:
    """:func:`decode_delta`, every field read in turn."""
    req = DeltaRequest()
    for num, a, b, wt in _fields(data, 0, len(data)):
        if num == 1:
            _check(wt, 2, num)
            req.node = _node(data, a, b)
        elif num == 2:
            _check(wt, 2, num)
            req.type_url = _str(data, a, b)
        elif num == 3:
            _check(wt, 2, num)
            req.resource_names_subscribe.append(_str(data, a, b))
        elif num == 4:
            _check(wt, 2, num)
            req.resource_names_unsubscribe.append(_str(data, a, b))
        elif num == 5:
            _check(wt, 2, num)
            key = value = ""
            for n2, a2, b2, wt2 in _fields(data, a, b):
                if n2 == 1 and wt2 == 2:
                    key = _str(data, a2, b2)
                elif n2 == 2 and wt2 == 2:
                    value = _str(data, a2, b2)
            req.initial_resource_versions[key] = value
        elif num == 6:
            _check(wt, 2, num)
            req.response_nonce = _str(data, a, b)
        elif num == 7:
            _check(wt, 2, num)
            req.error_detail = _status(data, a, b)
    return req
