"""xds.adswire against requests built to cost memory and time: a decode holds no per-field
list (memory stays what the result keeps), the count of fields (names included) one message
carries is bounded, and an int32 read from an overlong varint stays an int32."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from xds.adswire import MAX_FIELDS, WireError, decode_delta, decode_sotw


def _name_field(num: int, name: bytes) -> bytes:
    return bytes((num << 3 | 2, len(name))) + name


def test_four_mebibytes_of_empty_names_is_refused_quickly_and_cheaply() -> None:
    data = _name_field(3, b"") * (2 * 1024 * 1024)  # the largest message the transport lets in
    tracemalloc.start()
    try:
        started = time.process_time()
        with pytest.raises(WireError, match="fields"):
            decode_sotw(data)
        spent = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, peak  # before: ~320 MB (a tuple per field, then the names)
    assert spent < 2.0, spent  # before: seconds of the event loop (~25 s under tracemalloc)


def test_four_mebibytes_of_empty_unknown_fields_is_refused_quickly() -> None:
    data = b"\xfa\x06\x00" * 1_400_000  # field 111, empty, skipped by its wire type
    started = time.process_time()
    with pytest.raises(WireError, match="fields"):
        decode_sotw(data)
    spent = time.process_time() - started
    assert spent < 0.5, spent  # before: ~1.5 s (and ~200 MB) of the event loop


@pytest.mark.parametrize("num", [3, 4])
def test_the_name_count_is_bounded_in_both_delta_lists(num: int) -> None:
    field = _name_field(num, b"n")
    ok = decode_delta(field * MAX_FIELDS)
    got = ok.resource_names_subscribe if num == 3 else ok.resource_names_unsubscribe
    assert len(got) == MAX_FIELDS
    with pytest.raises(WireError):
        decode_delta(field * (MAX_FIELDS + 1))


def test_initial_resource_versions_are_bounded_too() -> None:
    entry = bytes((5 << 3 | 2, 3)) + _name_field(1, b"k")  # {"k": ""}, the same key again
    assert decode_delta(entry * MAX_FIELDS).initial_resource_versions == {"k": ""}
    with pytest.raises(WireError):
        decode_delta(entry * (MAX_FIELDS + 1))


def test_sotw_names_up_to_the_bound_decode() -> None:
    assert len(decode_sotw(_name_field(3, b"c") * MAX_FIELDS).resource_names) == MAX_FIELDS


def test_decoding_holds_little_beyond_what_the_result_keeps() -> None:
    names = [b"cluster-%06d" % i for i in range(50_000)]
    data = b"".join(_name_field(3, n) for n in names)
    tracemalloc.start()
    try:
        req = decode_sotw(data)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(req.resource_names) == 50_000
    assert peak < 1.5 * kept, (peak, kept)  # before: the field list doubled it


def test_an_overlong_status_code_varint_stays_an_int32() -> None:
    # error_detail (field 6) { code (field 1): a 10-byte varint with bits beyond 64 set }
    status = b"\x08" + b"\xff" * 9 + b"\x7f"
    req = decode_sotw(bytes((6 << 3 | 2, len(status))) + status)
    assert req.error_detail is not None
    assert req.error_detail.code == -1
    # the regular encoding of int32 -5 (sign-extended to 64 bits) still reads as -5
    neg = b"\x08" + bytes((0xFB,)) + b"\xff" * 8 + b"\x01"
    req = decode_sotw(bytes((6 << 3 | 2, len(neg))) + neg)
    assert req.error_detail is not None and req.error_detail.code == -5
