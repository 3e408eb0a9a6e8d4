from __future__ import annotations

import hashlib

import pytest

from certs.binding import DOMAIN, NONCE_LEN, binding_matches, expected_report_data

NONCE = bytes(range(NONCE_LEN))
SPKI = b"\x30\x59" + bytes(89)


def test_expected_report_data_is_deterministic_64_bytes_of_the_documented_formula() -> None:
    first = expected_report_data(NONCE, SPKI)
    assert first == expected_report_data(NONCE, SPKI)
    assert len(first) == 64
    assert first == hashlib.sha512(DOMAIN + NONCE + hashlib.sha256(SPKI).digest()).digest()


def test_binding_differs_with_nonce_and_with_key() -> None:
    base = expected_report_data(NONCE, SPKI)
    other_nonce = bytes([NONCE[0] ^ 1]) + NONCE[1:]
    assert expected_report_data(other_nonce, SPKI) != base
    assert expected_report_data(NONCE, SPKI + b"\x00") != base
    assert expected_report_data(NONCE, SPKI[:-1] + b"\x01") != base


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_wrong_nonce_length_is_refused(length: int) -> None:
    with pytest.raises(ValueError, match="nonce must be 32 bytes"):
        expected_report_data(bytes(length), SPKI)


def test_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="public key must not be empty"):
        expected_report_data(NONCE, b"")


def test_binding_matches_true_for_the_binding_and_longer_report_data() -> None:
    rd = expected_report_data(NONCE, SPKI)
    assert binding_matches(rd, NONCE, SPKI)
    # TEEs whose report-data field is longer than 64 bytes: only the first 64 count.
    assert binding_matches(rd + b"\xff" * 8, NONCE, SPKI)


def test_binding_matches_false_for_other_nonce_key_or_altered_bytes() -> None:
    rd = expected_report_data(NONCE, SPKI)
    assert not binding_matches(rd, bytes(NONCE_LEN), SPKI)
    assert not binding_matches(rd, NONCE, SPKI + b"\x00")
    for i in (0, 31, 63):
        flipped = bytearray(rd)
        flipped[i] ^= 0x80
        assert not binding_matches(bytes(flipped), NONCE, SPKI)
    assert not binding_matches(rd[:63], NONCE, SPKI)
    assert not binding_matches(b"", NONCE, SPKI)


def test_binding_matches_uses_constant_time_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    import certs.binding as binding

    calls: list[tuple[bytes, bytes]] = []

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(binding.hmac, "compare_digest", recording)
    rd = expected_report_data(NONCE, SPKI)
    assert binding.binding_matches(rd, NONCE, SPKI)
    assert calls == [(rd, rd)]
