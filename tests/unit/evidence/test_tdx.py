"""TDX verifier: the three real TDX vectors (v4, v4 SPR, v5), derived negatives, synthetic TCB."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Tee
from certs.evidence.dcap import (
    TdReport,
    parse_collateral,
    parse_enclave_identity,
    parse_quote,
    parse_tcb_info,
    split_signed_response,
)
from certs.evidence.tdx import TdxVerifier
from tests.unit.evidence import dcap_fixtures as fx
from tests.vectors import VECTORS, pin

ROOT = fx.intel_root()
V4 = fx.vector("tdx/dcapqvl_v4")
SPR = fx.vector("tdx/gotdxguest_v4_spr")
V5 = fx.vector("tdx/gotdxguest_v5")


@pytest.fixture(scope="module")
def verifier() -> TdxVerifier:
    return TdxVerifier(ROOT)


@pytest.fixture(scope="module")
def relaxed() -> TdxVerifier:
    """Explicitly relaxed: QE identity and CRLs optional (the v5 vector has none for 2026)."""
    return TdxVerifier(ROOT, require_qe_identity_and_crls=False)


def test_dcapqvl_v4_verifies_with_readme_fields(verifier: TdxVerifier) -> None:
    c = verifier.verify(V4.quote, now=V4.pin, collateral=V4.collateral)
    assert c.tee is Tee.TDX
    m = c.measurements
    assert m["mrtd"] == (
        "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407"
        "de03ae6dc5f87f27428b2538873118b7"
    )
    assert m["rtmr0"].startswith("44c0197b39157fdd") and m["rtmr0"].endswith("4b9bc9c0")
    assert m["rtmr1"].startswith("0084452c01668329") and m["rtmr2"].startswith("d833feef")
    assert m["rtmr3"] == "00" * 48
    assert m["mrseam"].startswith("5b38e33a6487958b")
    assert m["mrsignerseam"] == m["mrconfigid"] == m["mrowner"] == m["mrownerconfig"] == "00" * 48
    assert "mrservicetd" not in m
    assert c.report_data.hex() == (
        "9a9d48e7f6799642d3d1b34e1e5e1742d4bb02dd6ddd551862c1211d35c304f9"
        "eca3efdbb481601c163cf52493d6e44aed55d51ec39b7e518fadb92c2b523f20"
    )
    assert c.debug is False
    assert c.tcb_status == "UpToDate" and c.advisories == ()
    assert c.platform_id == "b0c06f000000"
    assert c.tcb["pce_svn"] == 11 and c.tcb["qe_svn"] == 6
    assert c.tcb["tdx_module_svn"] == 6 and c.tcb["tdx_module_version"] == 1
    d = c.details
    assert d["quote_version"] == 4
    assert d["tee_tcb_svn"] == "06010300000000000000000000000000"
    assert d["td_attributes"] == "0000001000000000" and d["xfam"] == "e702060000000000"
    assert d["tdx_module_tcb_status"] == "UpToDate" and d["qe_tcb_status"] == "UpToDate"
    assert d["pck_ca"] == "platform"


def test_spr_vector_has_no_matching_tcb_level(verifier: TdxVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(SPR.quote, now=SPR.pin, collateral=SPR.collateral)
    assert err.value.reason == "tcb_level_not_found"


def test_spr_vector_fields_parse() -> None:
    q = parse_quote(SPR.quote)
    body = q.body
    assert isinstance(body, TdReport)
    assert q.header.version == 4 and q.trailing == 39  # go-tdx-guest's unsigned test suffix
    assert q.signature.qe_report.isv_svn == 4 and q.signature.qe_report.isv_prod_id == 2
    assert body.report_data.hex().startswith("6c62dec1b8191749")


def test_v5_strict_default_demands_qe_identity_and_crls(verifier: TdxVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V5.quote, now=V5.pin, collateral=V5.collateral)
    assert err.value.reason == "collateral_missing"


def test_v5_verifies_with_explicit_relaxation(relaxed: TdxVerifier) -> None:
    c = relaxed.verify(V5.quote, now=V5.pin, collateral=V5.collateral)
    assert c.details["quote_version"] == 5 and c.details["body_type"] == 3
    assert c.details["qe_identity_checked"] is False and c.details["crls_checked"] is False
    assert c.details["tee_tcb_svn"] == "0b010400000000000000000000000000"
    assert c.details["tee_tcb_svn2"] == "0d010400000000000000000000000000"
    assert c.measurements["mrtd"].startswith("7348651a34b2d2d3")
    assert c.measurements["rtmr0"].startswith("5c8daf76063a71ac")
    assert c.measurements["mrservicetd"] == "00" * 48
    assert c.measurements["mrseam"].startswith("7bf063280e94fb05")
    assert c.report_data.hex().startswith("945eaacf5abc1f71")
    assert c.tcb["qe_svn"] == 7
    assert c.platform_id == "90c06f000000"
    assert c.tcb_status == "UpToDate" and c.details["tdx_module_tcb_status"] == "UpToDate"
    assert c.details["tcb_date"] == "2024-11-13T00:00:00Z"


def test_v5_with_the_expired_2023_tcb_signing_cert_is_rejected(relaxed: TdxVerifier) -> None:
    old = (VECTORS / "tdx/gotdxguest_v4_spr/tcb_info_issuer_chain.pem").read_bytes()
    coll = {**V5.collateral, "tcb_info_issuer_chain": old}
    with pytest.raises(EvidenceVerificationError) as err:
        relaxed.verify(V5.quote, now=V5.pin, collateral=coll)
    assert err.value.reason == "certificate_expired"
    # Both renewals present: the one valid at now is picked.
    both = {**V5.collateral, "tcb_info_issuer_chain": old + V5.collateral["tcb_info_issuer_chain"]}
    assert relaxed.verify(V5.quote, now=V5.pin, collateral=both).tcb_status == "UpToDate"


def test_v5_tcb_info_window(relaxed: TdxVerifier) -> None:
    for when, reason in (
        ("2026-03-03T14:49:27Z", "collateral_expired"),
        ("2026-02-01T14:49:25Z", "collateral_not_yet_valid"),
    ):
        with pytest.raises(EvidenceVerificationError) as err:
            relaxed.verify(V5.quote, now=pin(when), collateral=V5.collateral)
        assert err.value.reason == reason


@pytest.mark.parametrize("name", ["dcapqvl_v4", "gotdxguest_v5"])
def test_derived_negatives(relaxed: TdxVerifier, name: str) -> None:
    v = V4 if name == "dcapqvl_v4" else V5
    for case, mutated, reason in fx.derived_negatives(v.quote):
        with pytest.raises(EvidenceVerificationError) as err:
            relaxed.verify(mutated, now=v.pin, collateral=v.collateral)
        assert err.value.reason == reason, case


@pytest.mark.parametrize("cut", [0, 47, 48, 53, 54, 631, 632, 700, 770, 1154, 1220, 3000, 4935])
def test_truncation_is_a_format_error(verifier: TdxVerifier, cut: int) -> None:
    for v in (V4, V5):
        with pytest.raises(EvidenceFormatError):
            verifier.verify(v.quote[:cut], now=v.pin, collateral=v.collateral)


def test_wrong_root_is_untrusted() -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        TdxVerifier(fx.Pki().root_der).verify(V4.quote, now=V4.pin, collateral=V4.collateral)
    assert err.value.reason == "untrusted_root"


def test_sgx_quote_is_wrong_tee(verifier: TdxVerifier) -> None:
    s = fx.vector("sgx-dcap/dcapqvl_sgx_v3")
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(s.quote, now=s.pin, collateral=s.collateral)
    assert err.value.reason == "wrong_tee"


def test_tampered_tcb_info(verifier: TdxVerifier) -> None:
    doc = json.loads(V4.collateral["collateral_json"])
    doc["tcb_info"] = doc["tcb_info"].replace('"isvsvn":4', '"isvsvn":9', 1)
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(
            V4.quote, now=V4.pin, collateral={"collateral_json": json.dumps(doc).encode()}
        )
    assert err.value.reason == "collateral_signature_invalid"


def test_expired_collateral(verifier: TdxVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(V4.quote, now=pin("2025-07-19T10:00:36Z"), collateral=V4.collateral)
    assert err.value.reason == "collateral_expired"  # the PCK CRL's nextUpdate


# ---- synthetic TCB evaluation --------------------------------------------------------------


@pytest.fixture(scope="module")
def pki() -> fx.Pki:
    return fx.Pki()


def _verify(pki: fx.Pki, quote: bytes, coll: bytes) -> tuple[str | None, tuple[str, ...]]:
    claims = TdxVerifier(pki.root_der).verify(
        quote, now=fx.NOW, collateral={"collateral_json": coll}
    )
    return claims.tcb_status, claims.advisories


def test_debug_td_is_reported(pki: fx.Pki) -> None:
    attrs = bytes([0x01, 0, 0, 0x10, 0, 0, 0, 0])
    quote = fx.build_quote(pki, tdx=True, body=fx.td_report(td_attributes=attrs))
    claims = TdxVerifier(pki.root_der).verify(
        quote, now=fx.NOW, collateral={"collateral_json": fx.build_collateral(pki, tdx=True)}
    )
    assert claims.debug is True


def test_tdx_module_out_of_date_converges(pki: fx.Pki) -> None:
    coll = fx.build_collateral(
        pki,
        tdx=True,
        module_levels=[fx.isv_level("UpToDate", 9), fx.isv_level("OutOfDate", 2, ("SA-1",))],
    )
    assert _verify(pki, fx.build_quote(pki, tdx=True), coll) == ("OutOfDate", ("SA-1",))


def test_tdx_components_select_the_level(pki: fx.Pki) -> None:
    high = (5, 0, 9) + (0,) * 13
    coll = fx.build_collateral(
        pki,
        tdx=True,
        levels=[
            fx.platform_level("UpToDate", tdx=high),
            fx.platform_level("OutOfDate", tdx=fx.TDX_TCB, advisories=("SA-2",)),
        ],
    )
    assert _verify(pki, fx.build_quote(pki, tdx=True), coll) == ("OutOfDate", ("SA-2",))


def test_qe_out_of_date_with_configuration_needed(pki: fx.Pki) -> None:
    coll = fx.build_collateral(
        pki,
        tdx=True,
        levels=[fx.platform_level("ConfigurationNeeded", tdx=fx.TDX_TCB, advisories=("SA-3",))],
        qe_levels=[fx.isv_level("UpToDate", 9), fx.isv_level("OutOfDate", 2, ("Q-1",))],
    )
    quote = fx.build_quote(pki, tdx=True, qe_isvsvn=8)
    assert _verify(pki, quote, coll) == ("OutOfDateConfigurationNeeded", ("SA-3", "Q-1"))


def test_qe_below_every_level(pki: fx.Pki) -> None:
    coll = fx.build_collateral(pki, tdx=True, qe_levels=[fx.isv_level("UpToDate", 9)])
    with pytest.raises(EvidenceVerificationError) as err:
        _verify(pki, fx.build_quote(pki, tdx=True, qe_isvsvn=8), coll)
    assert err.value.reason == "qe_tcb_level_not_found"


def test_revoked_tcb_level_is_a_failure(pki: fx.Pki) -> None:
    coll = fx.build_collateral(pki, tdx=True, levels=[fx.platform_level("Revoked", tdx=fx.TDX_TCB)])
    with pytest.raises(EvidenceVerificationError) as err:
        _verify(pki, fx.build_quote(pki, tdx=True), coll)
    assert err.value.reason == "revoked"


def test_td15_body_in_v5(pki: fx.Pki) -> None:
    quote = fx.build_quote(pki, tdx=True, version=5, td15=True)
    status, _ = _verify(pki, quote, fx.build_collateral(pki, tdx=True))
    assert status == "UpToDate"


def test_unknown_tdx_module_version(pki: fx.Pki) -> None:
    body = fx.td_report(tee_tcb_svn=bytes([6, 2, 3]) + bytes(13))
    quote = fx.build_quote(pki, tdx=True, body=body)
    with pytest.raises(EvidenceVerificationError) as err:
        _verify(pki, quote, fx.build_collateral(pki, tdx=True))
    assert err.value.reason == "tdx_module_mismatch"


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1300), st.integers(1, 255), st.integers(0, 5006))
def test_parser_on_mutated_v5_quote(pos: int, mask: int, cut: int) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_quote(fx.flip(V5.quote, pos, mask)[: max(cut, 1)])


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=48, max_size=1500))
def test_parser_on_tdx_headers_with_random_rest(rest: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_quote(V4.quote[:48] + rest)
    with contextlib.suppress(EvidenceFormatError):
        parse_quote(V5.quote[:54] + rest)


# ---- collateral parsers: arbitrary input raises only the verification error -----------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def _mutated_tcb_info() -> st.SearchStrategy[bytes]:
    base = json.loads(json.loads(V4.collateral["collateral_json"])["tcb_info"])
    keys = sorted(base)
    return st.builds(lambda k, v: json.dumps({**base, k: v}).encode(), st.sampled_from(keys), _json)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300), _json.map(lambda j: json.dumps(j).encode()), _mutated_tcb_info()
    )
)
def test_collateral_parsers_raise_only_verification_errors(data: bytes) -> None:
    for parse in (parse_tcb_info, parse_enclave_identity):
        with contextlib.suppress(EvidenceVerificationError):
            parse(data)
    with contextlib.suppress(EvidenceVerificationError):
        split_signed_response(data, "tcbInfo")
    with contextlib.suppress(EvidenceVerificationError):
        parse_collateral({"collateral_json": data})
