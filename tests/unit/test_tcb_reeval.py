"""Continuous TCB re-evaluation (certs.tcb_reeval): claims on record against newer collateral.

Intel: quotes and collateral signed by the synthetic DCAP test root (tests/unit/evidence/
dcap_fixtures.py). The oracle is the verifier itself: re-evaluating the claims of a quote
verified with collateral A against collateral B gives what verifying the same quote with B
gives. AMD: a synthetic ARK signs the CRL. The real vectors' own collateral re-evaluates them
to the very same claims.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

import tests.unit.evidence.dcap_fixtures as fx
from certs.errors import EvidenceVerificationError
from certs.evidence.claims import Claims, Tee
from certs.evidence.dcap import DcapVerifier
from certs.evidence.sev_snp import SevSnpVerifier, parse_amd_chain
from certs.evidence.sgx_dcap import SgxVerifier
from certs.evidence.tdx import TdxVerifier
from certs.policy import OnTcbChange, parse_policies
from certs.tcb_reeval import (
    NO_TCB_LEVEL,
    Reevaluator,
    TcbCollateral,
    platform_keys,
    reappraise,
    reevaluate,
    tcb_action,
    verify_amd_crl,
)
from tests.unit.evidence.test_sev_snp import CHIP, IDBLOCK, SYN_NOW, SYN_TCB, TCB_RAW, _Amd, _sign
from tests.unit.fixtures_core import policy_doc
from tests.vectors import VECTORS


@pytest.fixture(scope="module")
def pki() -> fx.Pki:
    return fx.Pki()


def _coll(pki: fx.Pki, **kw: Any) -> dict[str, bytes]:
    return {"collateral_json": fx.build_collateral(pki, tdx=True, **kw)}


def _current(pki: fx.Pki, coll: dict[str, bytes], tee: str = "tdx") -> TcbCollateral:
    """What the monitor holds after verifying ``coll`` against the test root."""
    v = DcapVerifier(pki.root_der).verify_tcb_collateral(coll, now=fx.NOW)
    assert v.tcb_info is not None and v.qe_identity is not None
    assert v.pck_crl_revoked is not None
    return TcbCollateral(
        intel_tcb={(tee, v.tcb_info.fmspc.hex()): v.tcb_info},
        intel_qe={tee: v.qe_identity},
        intel_pck_revoked={"platform": v.pck_crl_revoked},
    )


def _tdx_claims(pki: fx.Pki, coll: dict[str, bytes], **quote: Any) -> Claims:
    return TdxVerifier(pki.root_der).verify(
        fx.build_quote(pki, tdx=True, **quote), now=fx.NOW, collateral=coll
    )


TDX_POLICY = policy_doc(
    "tdx-pol", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}}, onTcbChange="quarantine",
    tcbChangeGracePeriod="10m",
)  # fmt: skip


# Collateral variants a platform can be moved to; each is checked against a fresh verification.
HIGH = (5, 0, 9) + (0,) * 13
VARIANTS: dict[str, dict[str, Any]] = {
    "same": {},
    "platform-out-of-date": {
        "levels": [
            fx.platform_level("UpToDate", tdx=HIGH),
            fx.platform_level("OutOfDate", tdx=fx.TDX_TCB, advisories=("INTEL-SA-1",)),
        ]
    },
    "module-out-of-date": {
        "module_levels": [fx.isv_level("UpToDate", 9), fx.isv_level("OutOfDate", 2, ("SA-M",))]
    },
    "qe-out-of-date": {
        "qe_levels": [fx.isv_level("UpToDate", 9), fx.isv_level("OutOfDate", 2, ("SA-Q",))]
    },
    "configuration-needed": {
        "levels": [fx.platform_level("ConfigurationNeeded", tdx=fx.TDX_TCB, advisories=("C",))]
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reevaluation_agrees_with_a_fresh_verification(pki: fx.Pki, variant: str) -> None:
    before = _coll(pki)
    claims = _tdx_claims(pki, before)
    assert claims.tcb_status == "UpToDate"
    after = _coll(pki, **VARIANTS[variant])
    fresh = _tdx_claims(pki, after)
    again = reevaluate(claims, _current(pki, after))
    assert (again.tcb_status, again.advisories) == (fresh.tcb_status, fresh.advisories)
    for key in ("platform_tcb_status", "qe_tcb_status", "tdx_module_tcb_status", "tcb_date"):
        assert again.details[key] == fresh.details[key], key
    # nothing but the TCB verdict changes: measurements and identity are the evidence's
    assert again.measurements == claims.measurements
    assert again.evidence_sha256 == claims.evidence_sha256
    if variant == "same":
        assert again is claims


def test_a_platform_level_revoked_by_new_collateral_is_revoked(pki: fx.Pki) -> None:
    claims = _tdx_claims(pki, _coll(pki))
    after = _coll(pki, levels=[fx.platform_level("Revoked", tdx=fx.TDX_TCB)])
    with pytest.raises(EvidenceVerificationError) as err:  # a fresh verification refuses it
        _tdx_claims(pki, after)
    assert err.value.reason == "revoked"
    assert reevaluate(claims, _current(pki, after)).tcb_status == "Revoked"


def test_a_platform_below_every_new_level_has_no_level(pki: fx.Pki) -> None:
    claims = _tdx_claims(pki, _coll(pki))
    after = _coll(pki, levels=[fx.platform_level("UpToDate", tdx=HIGH)])
    with pytest.raises(EvidenceVerificationError):  # a fresh verification refuses it outright
        _tdx_claims(pki, after)
    assert reevaluate(claims, _current(pki, after)).tcb_status == NO_TCB_LEVEL


def test_a_pck_on_the_new_crl_is_revoked(pki: fx.Pki) -> None:
    claims = _tdx_claims(pki, _coll(pki))
    assert claims.details["pck_serial"] == "1234"
    again = reevaluate(claims, _current(pki, _coll(pki, revoked_pck=(0x1234,))))
    assert again.tcb_status == "Revoked" and again.details["pck_revoked"] is True
    unrelated = reevaluate(claims, _current(pki, _coll(pki, revoked_pck=(0x999,))))
    assert unrelated is claims


def test_older_collateral_never_rolls_a_verdict_back(pki: fx.Pki) -> None:
    claims = _tdx_claims(pki, _coll(pki))
    seen_newer = replace(claims, details={**claims.details, "tcb_eval_data_number": 18})
    older = _coll(pki, **VARIANTS["platform-out-of-date"])  # eval data number 17
    assert reevaluate(seen_newer, _current(pki, older)) is seen_newer


def test_sgx_claims_are_reevaluated_too(pki: fx.Pki) -> None:
    coll = {"collateral_json": fx.build_collateral(pki)}
    claims = SgxVerifier(pki.root_der).verify(fx.build_quote(pki), now=fx.NOW, collateral=coll)
    assert claims.tcb_status == "UpToDate"
    out = {"collateral_json": fx.build_collateral(pki, levels=[fx.platform_level("OutOfDate")])}
    again = reevaluate(claims, _current(pki, out, tee="sgx"))
    assert again.tcb_status == "OutOfDate"
    assert platform_keys(claims) >= {("intel-tcb", "sgx", fx.FMSPC.hex()), ("intel-qe", "sgx")}


def test_collateral_from_another_root_does_not_verify(pki: fx.Pki) -> None:
    other = fx.Pki()
    with pytest.raises(EvidenceVerificationError):
        DcapVerifier(pki.root_der).verify_tcb_collateral(_coll(other), now=fx.NOW)
    with pytest.raises(EvidenceVerificationError):  # expired
        DcapVerifier(pki.root_der).verify_tcb_collateral(
            _coll(pki), now=fx.NOW + timedelta(days=60)
        )


# -- appraisal and the action a policy asks for -------------------------------------------------


def test_reappraisal_finds_what_the_policy_no_longer_admits(pki: fx.Pki) -> None:
    (policy,) = parse_policies([TDX_POLICY])
    assert policy.on_tcb_change is OnTcbChange.QUARANTINE
    claims = _tdx_claims(pki, _coll(pki))
    same = _current(pki, _coll(pki))
    assert reappraise("w", claims, [policy], same, fx.NOW) is None
    moved = _current(pki, _coll(pki, **VARIANTS["platform-out-of-date"]))
    finding = reappraise("w", claims, [policy], moved, fx.NOW)
    assert finding is not None
    assert finding.action is OnTcbChange.QUARANTINE and finding.grace == timedelta(minutes=10)
    assert finding.decision.reasons == (
        "tcb_status_not_accepted: OutOfDate",
        "advisories_not_allowed: INTEL-SA-1",
    )
    assert not finding.revoked
    assert finding.evidence_sha256 == claims.evidence_sha256
    # a policy that accepts OutOfDate still admits the platform, but never a revoked one
    lenient_doc = policy_doc(
        "lenient", tees=["tdx"],
        refs={"tdx": {"mrtd": ["91" * 48], "allowedAdvisories": ["INTEL-SA-1"],
                      "acceptedTcbStatuses": ["UpToDate", "OutOfDate", "Revoked"]}},
    )  # fmt: skip
    (lenient,) = parse_policies([lenient_doc])
    assert reappraise("w", claims, [lenient], moved, fx.NOW) is None
    revoked = _current(pki, _coll(pki, revoked_pck=(0x1234,)))
    finding = reappraise("w", claims, [lenient], revoked, fx.NOW)
    assert finding is not None and finding.revoked and finding.action is OnTcbChange.AUDIT


def test_the_strictest_policy_decides_the_action(pki: fx.Pki) -> None:
    docs = [
        TDX_POLICY,
        policy_doc("audit", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}}),
        policy_doc("soon", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}},
                   onTcbChange="quarantine", tcbChangeGracePeriod="1m"),
        policy_doc("dry", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}}, mode="audit",
                   onTcbChange="quarantine"),
    ]  # fmt: skip
    policies = parse_policies(docs)
    claims = _tdx_claims(pki, _coll(pki))
    moved = _current(pki, _coll(pki, **VARIANTS["platform-out-of-date"]))
    finding = reappraise("w", claims, policies, moved, fx.NOW)
    assert finding is not None
    assert (finding.action, finding.grace) == (OnTcbChange.QUARANTINE, timedelta(minutes=1))
    audit_only = [p for p in policies if p.name.endswith("audit")]
    f2 = reappraise("w", claims, audit_only, moved, fx.NOW)
    assert f2 is not None and tcb_action(f2.decision, audit_only, fx.NOW)[0] is OnTcbChange.AUDIT


def test_a_non_tcb_rejection_is_not_a_tcb_finding(pki: fx.Pki) -> None:
    (other,) = parse_policies([policy_doc("m", tees=["tdx"], refs={"tdx": {"mrtd": ["00" * 48]}})])
    claims = _tdx_claims(pki, _coll(pki))
    moved = _current(pki, _coll(pki, **VARIANTS["platform-out-of-date"]))
    assert reappraise("w", claims, [other], moved, fx.NOW) is None  # set_policies' business


# -- AMD: a CRL signed by the (synthetic) ARK ---------------------------------------------------


def _amd_crl(amd: _Amd, revoked: tuple[int, ...], key: Any = None) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(amd.ark.subject)
        .last_update(SYN_NOW - timedelta(days=1))
        .next_update(SYN_NOW + timedelta(days=7))
    )
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(SYN_NOW - timedelta(days=1))
            .build()
        )
    crl = builder.sign(key or amd.ark_key, hashes.SHA384(), rsa_padding=amd.PSS)
    return crl.public_bytes(Encoding.DER)


def test_amd_claims_are_revoked_by_the_ark_signed_crl() -> None:
    amd = _Amd()
    chain = parse_amd_chain(amd.chain_pem())
    verifier = SevSnpVerifier([chain])
    vkey = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(vkey, SYN_TCB, CHIP, "Milan-B0")
    report = _sign(IDBLOCK.evidence(), vkey, reported_tcb=TCB_RAW, chip_id=CHIP)
    claims = verifier.verify(report, now=SYN_NOW, collateral={"vcek": vcek})
    assert claims.details["intermediate_serial"] == "1"
    assert platform_keys(claims) == {("amd-crl", "Milan")}
    clean = verify_amd_crl(_amd_crl(amd, (77,)), [chain], SYN_NOW)
    assert clean.product == "Milan" and clean.revoked == {77}
    assert reevaluate(claims, TcbCollateral(amd_revoked={"Milan": clean.revoked})) is claims
    ask_revoked = verify_amd_crl(_amd_crl(amd, (1,)), [chain], SYN_NOW)
    again = reevaluate(claims, TcbCollateral(amd_revoked={"Milan": ask_revoked.revoked}))
    assert again.tcb_status == "Revoked"
    # the synthetic PKI gives the VCEK and the ASK serial 1 alike: both are named
    assert again.details["revoked_by_crl"] == "endorsement_serial,intermediate_serial"
    refs = {"sevSnp": {"measurement": [claims.measurements["measurement"]]}}
    (policy,) = parse_policies([policy_doc("snp", tees=["sev-snp"], refs=refs)])
    on_crl = TcbCollateral(amd_revoked={"Milan": frozenset({1})})
    finding = reappraise("w", claims, [policy], on_crl, SYN_NOW)
    assert finding is not None and finding.revoked


def test_an_amd_crl_not_signed_by_a_pinned_ark_is_refused() -> None:
    amd, rogue, genoa = _Amd(), _Amd(), _Amd("Genoa")
    chain = parse_amd_chain(amd.chain_pem())
    with pytest.raises(EvidenceVerificationError) as err:
        verify_amd_crl(_amd_crl(amd, (1,), key=rogue.ark_key), [chain], SYN_NOW)
    assert err.value.reason == "collateral_signature_invalid"
    with pytest.raises(EvidenceVerificationError) as err:
        verify_amd_crl(_amd_crl(genoa, (1,)), [chain], SYN_NOW)
    assert err.value.reason == "untrusted_root"
    with pytest.raises(EvidenceVerificationError) as err:
        verify_amd_crl(_amd_crl(amd, ()), [chain], SYN_NOW + timedelta(days=30))
    assert err.value.reason == "collateral_expired"
    with pytest.raises(EvidenceVerificationError) as err:
        verify_amd_crl(b"\x30\x03junk", [chain], SYN_NOW)
    assert err.value.reason == "collateral_invalid"


# -- the real vectors keep verifying --------------------------------------------------------------


@pytest.mark.parametrize("name", ["tdx/dcapqvl_v4", "sgx-dcap/dcapqvl_sgx_v3"])
def test_real_vectors_reevaluate_to_the_same_claims_with_their_own_collateral(name: str) -> None:
    v = fx.vector(name)
    root = fx.intel_root()
    verifier = TdxVerifier(root) if name.startswith("tdx") else SgxVerifier(root)
    claims = verifier.verify(v.quote, now=v.pin, collateral=v.collateral)
    checked = DcapVerifier(root).verify_tcb_collateral(v.collateral, now=v.pin)
    assert checked.tcb_info is not None
    tee = claims.tee.value
    fmspc = str(claims.details["fmspc"]).lower()
    coll = TcbCollateral(
        intel_tcb={(tee, fmspc): checked.tcb_info},
        intel_qe={tee: checked.qe_identity} if checked.qe_identity is not None else {},
        intel_pck_revoked=(
            {str(claims.details["pck_ca"]): checked.pck_crl_revoked}
            if checked.pck_crl_revoked is not None
            else {}
        ),
    )
    assert reevaluate(claims, coll) is claims
    # and they still verify, unchanged, afterwards
    assert verifier.verify(v.quote, now=v.pin, collateral=v.collateral) == claims
    assert (VECTORS / name).is_dir()


def test_real_pcs_documents_verify_for_reevaluation() -> None:
    """The go-tdx-guest SPR vector carries PCS responses in their served form (signed JSON
    bodies, issuer chains, DER CRLs): the monitor's verification path reads them."""
    v = fx.vector("tdx/gotdxguest_v4_spr")
    checked = DcapVerifier(fx.intel_root()).verify_tcb_collateral(v.collateral, now=v.pin)
    assert checked.tcb_info is not None and checked.tcb_info.fmspc.hex() == "50806f000000"
    assert checked.qe_identity is not None and checked.pck_crl_revoked is not None
    assert checked.pck_crl_next_update is not None and checked.pck_crl_next_update > v.pin


def test_claims_without_tcb_facts_have_nothing_to_reevaluate() -> None:
    from tests.unit.fixtures_core import claims as sim_claims

    c = sim_claims(Tee.SIM)
    assert platform_keys(c) == frozenset()
    assert reevaluate(c, TcbCollateral(amd_revoked={"Milan": frozenset({1})})) is c


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_memoised_reevaluator_equals_reevaluate(pki: fx.Pki, variant: str) -> None:
    base = _tdx_claims(pki, _coll(pki))
    current = _current(pki, _coll(pki, revoked_pck=(0x77,), **VARIANTS[variant]))
    siblings = [
        base,
        replace(base, evidence_sha256="cd" * 32),  # another workload, same platform
        replace(base, details={**base.details, "pck_serial": "77"}),  # its PCK is revoked
        replace(base, details={**base.details, "tcb_date": "2020-01-01T00:00:00Z"}),
        replace(base, tcb={**base.tcb, "qe_svn": 1}),  # an older QE
    ]
    memo = Reevaluator(current)
    for claims in siblings * 2:  # the second round comes from the memo
        assert memo(claims) == reevaluate(claims, current)
    assert memo(siblings[1]).evidence_sha256 == "cd" * 32
