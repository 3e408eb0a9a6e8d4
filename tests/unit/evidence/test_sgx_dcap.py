"""SGX DCAP (quote v3) verifier: the real dcap-qvl vector, derived negatives, synthetic cases."""

from __future__ import annotations

import contextlib
import json
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.binding import binding_matches
from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence import sgx_dcap, tdx
from certs.evidence.claims import Tee
from certs.evidence.dcap import parse_quote
from certs.evidence.sgx_dcap import SgxVerifier
from tests.unit.evidence import dcap_fixtures as fx
from tests.vectors import pin

V = fx.vector("sgx-dcap/dcapqvl_sgx_v3")
ROOT = fx.intel_root()


@pytest.fixture(scope="module")
def verifier() -> SgxVerifier:
    return SgxVerifier(ROOT)


def test_vector_verifies_with_readme_fields(verifier: SgxVerifier) -> None:
    claims = verifier.verify(V.quote, now=V.pin, collateral=V.collateral)
    assert claims.tee is Tee.SGX
    assert claims.measurements == {
        "mrenclave": "33d8736db756ed4997e04ba358d27833188f1932ff7b1d156904d3f560452fbb",
        "mrsigner": "815f42f11cf64430c30bab7816ba596a1da0130c3b028b673133a66cf9a3e0e6",
    }
    assert claims.signer == claims.measurements["mrsigner"]
    assert claims.product_id == 0
    assert claims.svn == 0
    assert claims.debug is False
    assert claims.report_data == b"Hello, world!" + bytes(51)
    assert claims.tcb_status == "ConfigurationAndSWHardeningNeeded"
    assert claims.advisories == ("INTEL-SA-00289", "INTEL-SA-00615")
    assert claims.platform_id == "00a067110000"
    assert claims.tcb["pce_svn"] == 13
    assert claims.tcb["qe_svn"] == 10
    assert [claims.tcb[f"sgx_tcb_comp{i:02d}"] for i in range(1, 8)] == [11, 11, 2, 2, 255, 1, 0]
    d = claims.details
    assert d["quote_version"] == 3
    assert d["header_qe_svn"] == 10 and d["header_pce_svn"] == 15
    assert d["attributes"] == "0500000000000000e700000000000000"
    assert d["misc_select"] == 0
    assert d["pck_ca"] == "processor"
    assert d["tcb_date"] == "2024-03-13T00:00:00Z"
    assert d["qe_tcb_status"] == "UpToDate"
    assert d["qe_identity_checked"] is True and d["crls_checked"] is True
    assert len(claims.evidence_sha256) == 64


def test_header_and_qe_report_parse() -> None:
    q = parse_quote(V.quote)
    assert (q.header.version, q.header.att_key_type, q.header.tee_type) == (3, 2, 0)
    assert q.header.qe_vendor_id.hex() == "939a7233f79c4ca9940a0db3957f0607"
    qe = q.signature.qe_report
    assert qe.mr_signer.hex() == "8c4f5775d796503e96137f77c68a829a0056ac8ded70140b081b094490c57bff"
    assert (qe.isv_prod_id, qe.isv_svn) == (1, 10)
    assert q.signature.qe_auth_data == bytes(range(32))
    assert q.signature.pck_chain_pem.endswith(b"\x00")


def test_looks_like_distinguishes_sgx_from_tdx() -> None:
    tdx_quote = fx.vector("tdx/dcapqvl_v4").quote
    assert sgx_dcap.looks_like(V.quote) and not tdx.looks_like(V.quote)
    assert tdx.looks_like(tdx_quote) and not sgx_dcap.looks_like(tdx_quote)
    assert not sgx_dcap.looks_like(b"") and not sgx_dcap.looks_like(b"\x03\x00" * 300)


def test_tdx_quote_is_wrong_tee(verifier: SgxVerifier) -> None:
    t = fx.vector("tdx/dcapqvl_v4")
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(t.quote, now=t.pin, collateral=t.collateral)
    assert err.value.reason == "wrong_tee"


@pytest.mark.parametrize(
    ("case", "mutated", "reason"), fx.derived_negatives(V.quote), ids=lambda x: str(x)[:24]
)
def test_flipped_bytes_fail_with_precise_reason(
    verifier: SgxVerifier, case: str, mutated: bytes, reason: str
) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(mutated, now=V.pin, collateral=V.collateral)
    assert err.value.reason == reason, case


@pytest.mark.parametrize("cut", [0, 10, 47, 48, 200, 431, 436, 500, 1000, 1046, 2000, 4599])
def test_truncation_is_a_format_error(verifier: SgxVerifier, cut: int) -> None:
    with pytest.raises(EvidenceFormatError):
        verifier.verify(V.quote[:cut], now=V.pin, collateral=V.collateral)


def test_wrong_root_is_untrusted() -> None:
    other = SgxVerifier(fx.Pki().root_der)
    with pytest.raises(EvidenceVerificationError) as err:
        other.verify(V.quote, now=V.pin, collateral=V.collateral)
    assert err.value.reason == "untrusted_root"


@pytest.mark.parametrize(
    ("when", "reason"),
    [
        ("2025-07-19T10:01:19Z", "collateral_expired"),  # QE identity nextUpdate passed
        ("2025-07-20T00:00:00Z", "collateral_expired"),  # TCB info and CRL too
        ("2025-06-19T10:30:00Z", "collateral_not_yet_valid"),  # before TCB info issueDate
        ("2025-06-19T10:00:00Z", "collateral_not_yet_valid"),  # before the PCK CRL
        ("2031-01-01T00:00:00Z", "certificate_expired"),  # PCK leaf expired
    ],
)
def test_time_outside_window(verifier: SgxVerifier, when: str, reason: str) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V.quote, now=pin(when), collateral=V.collateral)
    assert err.value.reason == reason


def _tampered(field: str, old: str, new: str) -> dict[str, bytes]:
    doc = json.loads(V.collateral["collateral_json"])
    assert old in doc[field]
    doc[field] = doc[field].replace(old, new, 1)
    return {"collateral_json": json.dumps(doc).encode()}


def test_tampered_tcb_info_signature_fails(verifier: SgxVerifier) -> None:
    coll = _tampered("tcb_info", '"tcbStatus":"OutOfDate"', '"tcbStatus":"UpToDate"')
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V.quote, now=V.pin, collateral=coll)
    assert err.value.reason == "collateral_signature_invalid"


def test_tampered_qe_identity_signature_fails(verifier: SgxVerifier) -> None:
    coll = _tampered("qe_identity", '"isvprodid":1', '"isvprodid":3')
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V.quote, now=V.pin, collateral=coll)
    assert err.value.reason == "collateral_signature_invalid"


@pytest.mark.parametrize("missing", ["tcb_info", "qe_identity", "pck_crl", "root_ca_crl"])
def test_missing_collateral_is_named(verifier: SgxVerifier, missing: str) -> None:
    doc = json.loads(V.collateral["collateral_json"])
    coll: dict[str, bytes] = {}  # the split (raw PCS) form, then one part dropped
    coll["tcb_info"] = (
        '{"tcbInfo":' + doc["tcb_info"] + ',"signature":"' + doc["tcb_info_signature"] + '"}'
    ).encode()
    coll["tcb_info_issuer_chain"] = doc["tcb_info_issuer_chain"].encode()
    coll["qe_identity"] = (
        '{"enclaveIdentity":'
        + doc["qe_identity"]
        + ',"signature":"'
        + doc["qe_identity_signature"]
        + '"}'
    ).encode()
    coll["qe_identity_issuer_chain"] = doc["qe_identity_issuer_chain"].encode()
    coll["pck_crl"] = bytes.fromhex(doc["pck_crl"])
    coll["root_ca_crl"] = bytes.fromhex(doc["root_ca_crl"])
    coll["pck_crl_issuer_chain"] = doc["pck_crl_issuer_chain"].encode()
    assert verifier.verify(V.quote, now=V.pin, collateral=coll).tcb_status
    del coll[missing]
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V.quote, now=V.pin, collateral=coll)
    assert err.value.reason == "collateral_missing"


def test_report_data_does_not_match_a_binding(verifier: SgxVerifier) -> None:
    claims = verifier.verify(V.quote, now=V.pin, collateral=V.collateral)
    assert not binding_matches(claims.report_data, bytes(32), b"some spki")


# ---- synthetic (test PKI) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def pki() -> fx.Pki:
    return fx.Pki()


def _verify_synth(pki: fx.Pki, quote: bytes, coll: bytes) -> object:
    return SgxVerifier(pki.root_der).verify(quote, now=fx.NOW, collateral={"collateral_json": coll})


def test_debug_enclave_is_reported(pki: fx.Pki) -> None:
    debug_attrs = bytes.fromhex("0700000000000000e700000000000000")
    quote = fx.build_quote(pki, body=fx.enclave_report(attributes=debug_attrs, isv_svn=3))
    claims = SgxVerifier(pki.root_der).verify(
        quote, now=fx.NOW, collateral={"collateral_json": fx.build_collateral(pki)}
    )
    assert claims.debug is True and claims.svn == 3
    clean = fx.build_quote(pki)
    assert (
        not SgxVerifier(pki.root_der)
        .verify(clean, now=fx.NOW, collateral={"collateral_json": fx.build_collateral(pki)})
        .debug
    )


def test_revoked_pck_certificate(pki: fx.Pki) -> None:
    coll = fx.build_collateral(pki, revoked_pck=(pki.pck.serial_number,))
    with pytest.raises(EvidenceVerificationError) as err:
        _verify_synth(pki, fx.build_quote(pki), coll)
    assert err.value.reason == "revoked"


def test_fmspc_mismatch(pki: fx.Pki) -> None:
    coll = fx.build_collateral(pki, fmspc=bytes(6))
    with pytest.raises(EvidenceVerificationError) as err:
        _verify_synth(pki, fx.build_quote(pki), coll)
    assert err.value.reason == "fmspc_mismatch"


def test_sgx_quotes_must_be_v3(pki: fx.Pki) -> None:
    coll = {"collateral_json": fx.build_collateral(pki)}
    for version in (4, 5):
        quote = fx.build_quote(pki, version=version)
        assert not sgx_dcap.looks_like(quote)
        with pytest.raises(EvidenceFormatError) as err:
            SgxVerifier(pki.root_der).verify(quote, now=fx.NOW, collateral=coll)
        assert err.value.reason == "quote_unsupported"


def test_expired_by_one_second(pki: fx.Pki) -> None:
    coll = {"collateral_json": fx.build_collateral(pki)}
    later = fx.T0 + timedelta(days=30, seconds=1)
    with pytest.raises(EvidenceVerificationError) as err:
        SgxVerifier(pki.root_der).verify(fx.build_quote(pki), now=later, collateral=coll)
    assert err.value.reason == "collateral_expired"


# ---- parser properties ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_parser_raises_only_format_errors_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_quote(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1100), st.integers(1, 255), st.integers(0, 4600))
def test_parser_on_mutated_real_quote(pos: int, mask: int, cut: int) -> None:
    data = fx.flip(V.quote, pos, mask)[: max(cut, 1)]
    with contextlib.suppress(EvidenceFormatError):
        parse_quote(data)
