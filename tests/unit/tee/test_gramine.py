"""Gramine /dev/attestation collector against a fake directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from certs.evidence.sgx_dcap import SgxVerifier
from sidecar.tee.gramine import GramineCollector, GramineError
from tests.unit.evidence import dcap_fixtures as fx

REPORT_DATA = bytes(range(64))


@pytest.fixture(scope="module")
def pki() -> fx.Pki:
    return fx.Pki()


def _fake(root: Path, *, kind: bytes = b"dcap", quote: bytes | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "attestation_type").write_bytes(kind)
    (root / "user_report_data").write_bytes(bytes(64))
    if quote is not None:
        (root / "quote").write_bytes(quote)
    return root


def test_collects_a_verifiable_quote(tmp_path: Path, pki: fx.Pki) -> None:
    quote = fx.build_quote(pki, body=fx.enclave_report(report_data=REPORT_DATA))
    root = _fake(tmp_path / "attestation", quote=quote)
    got = GramineCollector(root).collect(REPORT_DATA)
    assert got == quote
    assert (root / "user_report_data").read_bytes() == REPORT_DATA
    claims = SgxVerifier(pki.root_der).verify(
        got, now=fx.NOW, collateral={"collateral_json": fx.build_collateral(pki)}
    )
    assert claims.report_data == REPORT_DATA


def test_attestation_type_with_trailing_newline(tmp_path: Path) -> None:
    root = _fake(tmp_path, kind=b"dcap\n")
    assert GramineCollector(root).attestation_type() == "dcap"


def test_non_dcap_is_refused(tmp_path: Path) -> None:
    root = _fake(tmp_path, kind=b"epid")
    with pytest.raises(GramineError) as err:
        GramineCollector(root).collect(REPORT_DATA)
    assert err.value.reason == "gramine_not_dcap"
    assert (root / "user_report_data").read_bytes() == bytes(64)  # nothing written


def test_missing_device_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(GramineError) as err:
        GramineCollector(tmp_path / "absent").collect(REPORT_DATA)
    assert err.value.reason == "gramine_unavailable"


def test_quote_with_other_report_data_is_rejected(tmp_path: Path, pki: fx.Pki) -> None:
    root = _fake(tmp_path, quote=fx.build_quote(pki))
    with pytest.raises(GramineError) as err:
        GramineCollector(root).collect(REPORT_DATA)
    assert err.value.reason == "gramine_quote_invalid"


def test_not_a_quote(tmp_path: Path) -> None:
    root = _fake(tmp_path, quote=b"\x00" * 1000)
    with pytest.raises(GramineError) as err:
        GramineCollector(root).collect(REPORT_DATA)
    assert err.value.reason == "gramine_quote_invalid"


def test_missing_quote_file_is_io_error(tmp_path: Path) -> None:
    root = _fake(tmp_path)
    with pytest.raises(GramineError) as err:
        GramineCollector(root).collect(REPORT_DATA)
    assert err.value.reason == "gramine_io"


def test_report_data_length_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        GramineCollector(_fake(tmp_path)).collect(b"short")
