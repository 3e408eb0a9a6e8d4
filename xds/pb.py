"""betterproto2 handling: one place that knows how messages become bytes, and how cheaply.

Two deliberate decisions (measured in ``benchmarks/bench_xds.py``):

1. Never re-serialize. Each resource is serialized once, into the bytes of a
   ``google.protobuf.Any``, when it changes (``pack``); a ``DiscoveryResponse`` is framed by hand
   around those bytes (``encode_discovery_response``) and sent as :class:`Encoded`, which
   grpclib's ``ProtoCodec`` passes through untouched.
2. betterproto2 0.9.1 builds a fresh pydantic ``SchemaValidator`` on every ``bytes(msg)`` and
   ``parse()``. :func:`install_validator_cache` swaps ``Message._validate`` for one that caches a
   validator per class (same schema, same validation, same errors). It is explicit (called from
   ``warm``/``main``), version-pinned and reversible; it is not applied at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Final, cast

import betterproto2
import pydantic_core

from xds.resources import TypeUrl

PATCHED_VERSION: Final = "0.9.1"
_ORIGINAL_VALIDATE: Final[Callable[..., None]] = betterproto2.Message._validate
_VALIDATORS: dict[type, tuple[object, pydantic_core.SchemaValidator]] = {}


def _cached_validate(self: betterproto2.Message) -> None:
    # Same body as betterproto2 0.9.1 Message._validate, except the SchemaValidator is built once
    # per class (and rebuilt if pydantic ever replaces the class's core schema).
    if not self._is_pydantic():
        raise TypeError("Validation is only available for pydantic dataclasses.")
    cls = type(self)
    schema = getattr(cls, "__pydantic_core_schema__")  # noqa: B009 (set by pydantic)
    entry = _VALIDATORS.get(cls)
    if entry is None or entry[0] is not schema:
        entry = (schema, pydantic_core.SchemaValidator(schema))
        _VALIDATORS[cls] = entry
    values = self.__dict__.copy()
    del values["_unknown_fields"]
    entry[1].validate_python(values)


def install_validator_cache() -> bool:
    """Cache one pydantic validator per message class. Idempotent; False if not applicable.

    Applies only to the betterproto2 version it was written and tested against.
    """
    if betterproto2.__version__ != PATCHED_VERSION:
        return False
    setattr(betterproto2.Message, "_validate", _cached_validate)  # noqa: B010
    return True


def uninstall_validator_cache() -> None:
    """Restore betterproto2's own ``_validate`` (benchmarks measure the naive baseline)."""
    setattr(betterproto2.Message, "_validate", _ORIGINAL_VALIDATE)  # noqa: B010
    _VALIDATORS.clear()


def validator_cache_installed() -> bool:
    return cast(object, betterproto2.Message._validate) is _cached_validate


# ---------------------------------------------------------------------------------------------
# hand framing of the two wire messages that wrap pre-serialized bytes


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_ONE_BYTE = tuple(bytes((i,)) for i in range(0x80))


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


@functools.lru_cache(maxsize=64)
def _ld_str(field: int, text: str) -> bytes:
    return _ld(field, text.encode())


def pack(message: betterproto2.Message, type_url: TypeUrl) -> bytes:
    """Serialize ``message`` once into the bytes of a ``google.protobuf.Any``."""
    value = bytes(message)
    return _ld_str(1, str(type_url)) + (_ld(2, value) if value else b"")


def pack_bytes(value: bytes, type_url: TypeUrl) -> bytes:
    """The bytes of a ``google.protobuf.Any`` around an already serialized message."""
    return _ld_str(1, str(type_url)) + (_ld(2, value) if value else b"")


# Hand encodings of the few small messages built per workload (each one tested byte for byte
# against betterproto2's serialization): per-node resources and large endpoint lists become
# concatenations instead of message trees.


def encode_address(host: str, port: int) -> bytes:
    """``envoy.config.core.v3.Address{socket_address{address, port_value}}``."""
    socket = _ld(2, host.encode()) + (_varint(3 << 3) + _varint(port) if port else b"")
    return _ld(1, socket)


def encode_lb_endpoint(host: str, port: int) -> bytes:
    """``LbEndpoint{endpoint{address}}`` as a ``lb_endpoints`` entry of LocalityLbEndpoints."""
    return _ld(2, _ld(1, _ld(1, encode_address(host, port))))


def encode_load_assignment(cluster_name: str, lb_endpoints: Iterable[bytes]) -> bytes:
    """``ClusterLoadAssignment{cluster_name, endpoints: [LocalityLbEndpoints{lb_endpoints}]}``
    from ``encode_lb_endpoint`` entries (none: no locality at all)."""
    entries = b"".join(lb_endpoints)
    return _ld(1, cluster_name.encode()) + (_ld(2, entries) if entries else b"")


def encode_discovery_response(
    version_info: str, type_url: TypeUrl, nonce: str, resources: Iterable[bytes]
) -> bytes:
    """A ``DiscoveryResponse`` around already packed ``Any`` bytes (fields 1, 2, 4, 5)."""
    parts = [_ld(1, version_info.encode())] if version_info else []
    parts.extend(_ld(2, r) for r in resources)
    parts.append(_ld_str(4, str(type_url)))
    if nonce:
        parts.append(_ld(5, nonce.encode()))
    return b"".join(parts)


def encode_delta_discovery_response(
    system_version_info: str,
    type_url: TypeUrl,
    nonce: str,
    resources: Iterable[tuple[str, str, bytes]],
    removed: Iterable[str] = (),
) -> bytes:
    """A ``DeltaDiscoveryResponse`` (fields 1, 2, 4, 5, 6) whose ``resources`` are
    ``Resource`` messages (name 3, version 1, resource 2) wrapped around already packed ``Any``
    bytes, given as ``(name, version, packed)``. Each packed resource is copied once, into the
    returned message."""
    parts = [_ld(1, system_version_info.encode())] if system_version_info else []
    for name, version, packed in resources:
        head = _ld(3, name.encode()) + (_ld(1, version.encode()) if version else b"")
        any_head = _varint(2 << 3 | 2) + _varint(len(packed))
        size = len(head) + len(any_head) + len(packed)
        parts.extend((_varint(2 << 3 | 2), _varint(size), head, any_head, packed))
    parts.append(_ld_str(4, str(type_url)))
    if nonce:
        parts.append(_ld(5, nonce.encode()))
    parts.extend(_ld(6, name.encode()) for name in removed)
    return b"".join(parts)


class Encoded:
    """Pre-encoded message bytes that grpclib's ProtoCodec sends as they are."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # grpclib codec protocol
        return self.data

    @classmethod
    def FromString(cls, data: bytes) -> Encoded:
        return cls(bytes(data))


def warm(messages: Iterable[Callable[[], betterproto2.Message]]) -> None:
    """Construct, serialize and parse each message kind once (lazy schemas cost ~0.6 s cold)."""
    for make in messages:
        msg = make()
        type(msg).parse(bytes(msg))


__all__ = [
    "Encoded",
    "encode_address",
    "encode_delta_discovery_response",
    "encode_discovery_response",
    "encode_lb_endpoint",
    "encode_load_assignment",
    "install_validator_cache",
    "pack",
    "pack_bytes",
    "uninstall_validator_cache",
    "validator_cache_installed",
    "warm",
]
