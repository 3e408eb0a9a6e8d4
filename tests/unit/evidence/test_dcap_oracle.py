"""dcap-qvl as a differential oracle for the Intel DCAP verifier.

dcap-qvl is a declared test dependency: it is imported unconditionally, so a missing install
fails this module instead of skipping it.

Agreement means: both accept or both reject; when both accept, the same TCB status and the same
advisory ids. dcap-qvl folds two policy checks into verification (debug enclaves/TDs are
rejected; TDs must set SEPT_VE_DISABLE): attestmesh reports ``debug`` as a claim for
``appraise`` to decide, so "accept" on our side means verified *and* not debug.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import dcap_qvl
import pytest

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims
from certs.evidence.dcap import DcapVerifier, split_signed_response
from certs.evidence.sgx_dcap import SgxVerifier
from certs.evidence.sgx_dcap import claims_from as sgx_claims
from certs.evidence.tdx import TdxVerifier
from certs.evidence.tdx import claims_from as tdx_claims
from tests.unit.evidence import dcap_fixtures as fx
from tests.vectors import pin

INTEL_ROOT = fx.intel_root()


@dataclass(frozen=True)
class Case:
    name: str
    quote: bytes
    collateral: dict[str, bytes]
    now: datetime
    root: bytes = INTEL_ROOT


@dataclass(frozen=True)
class Outcome:
    accepted: bool
    status: str | None = None
    advisories: tuple[str, ...] = ()
    why: str = ""


def to_qvl(collateral: dict[str, bytes]) -> dcap_qvl.QuoteCollateralV3:
    if "collateral_json" in collateral:
        return dcap_qvl.QuoteCollateralV3.from_json(collateral["collateral_json"].decode())
    tcb, tcb_sig = split_signed_response(collateral["tcb_info"], "tcbInfo")
    qe, qe_sig = split_signed_response(collateral["qe_identity"], "enclaveIdentity")
    return dcap_qvl.QuoteCollateralV3(
        collateral["pck_crl_issuer_chain"].decode(),
        collateral["root_ca_crl"],
        collateral["pck_crl"],
        collateral["tcb_info_issuer_chain"].decode(),
        tcb.decode(),
        tcb_sig,
        collateral["qe_identity_issuer_chain"].decode(),
        qe.decode(),
        qe_sig,
    )


def run_qvl(case: Case) -> Outcome:
    try:
        report = dcap_qvl.verify_with_root_ca(
            case.quote, to_qvl(case.collateral), case.root, int(case.now.timestamp())
        )
    except ValueError as exc:
        return Outcome(False, why=str(exc).splitlines()[0])
    return Outcome(True, report.status, tuple(sorted(report.advisory_ids)))


_VERIFIERS: dict[bytes, DcapVerifier] = {}


def run_ours(case: Case) -> Outcome:
    core = _VERIFIERS.setdefault(case.root, DcapVerifier(case.root))
    try:
        verified = core.verify_quote(case.quote, now=case.now, collateral=case.collateral)
    except (EvidenceFormatError, EvidenceVerificationError) as exc:
        return Outcome(False, why=exc.reason)
    claims: Claims = (tdx_claims if verified.quote.is_tdx else sgx_claims)(verified, case.quote)
    if claims.debug:
        return Outcome(False, why="debug (policy)")
    return Outcome(True, claims.tcb_status, tuple(sorted(claims.advisories)))


def _real_cases() -> list[Case]:
    cases: list[Case] = []
    for name in ("sgx-dcap/dcapqvl_sgx_v3", "tdx/dcapqvl_v4", "tdx/gotdxguest_v4_spr"):
        v = fx.vector(name)
        cases.append(Case(name, v.quote, v.collateral, v.pin))
        for case, mutated, _ in fx.derived_negatives(v.quote):
            cases.append(Case(f"{name}:{case}", mutated, v.collateral, v.pin))
        for cut in (47, 600, len(v.quote) // 2, len(v.quote) - 300):
            cases.append(Case(f"{name}:cut{cut}", v.quote[:cut], v.collateral, v.pin))
        for days in (-400, -1, 35, 3000):
            when = v.pin + timedelta(days=days)
            cases.append(Case(f"{name}:at{days:+d}d", v.quote, v.collateral, when))
        cases.append(Case(f"{name}:wrong_root", v.quote, v.collateral, v.pin, fx.Pki().root_der))
    # v5: no time-consistent QE identity / CRLs exist, so strict verification must reject in both.
    v5, spr = fx.vector("tdx/gotdxguest_v5"), fx.vector("tdx/gotdxguest_v4_spr")
    v5_coll = {**spr.collateral, **v5.collateral}
    cases.append(Case("tdx/gotdxguest_v5:strict", v5.quote, v5_coll, v5.pin))
    # Tampered TCB info (JSON form) for both dcap-qvl vectors.
    for name in ("sgx-dcap/dcapqvl_sgx_v3", "tdx/dcapqvl_v4"):
        v = fx.vector(name)
        doc = json.loads(v.collateral["collateral_json"])
        doc["tcb_info"] = doc["tcb_info"].replace('"pcesvn":13', '"pcesvn":3', 1)
        doc["tcb_info"] = doc["tcb_info"].replace('"pcesvn":11', '"pcesvn":1', 1)
        coll = {"collateral_json": json.dumps(doc).encode()}
        cases.append(Case(f"{name}:tampered_tcb_info", v.quote, coll, v.pin))
    return cases


_PKI = fx.Pki()
_SGX_UP = fx.platform_level("UpToDate")


def _synth(
    name: str, *, tdx: bool = False, quote: dict[str, object] | None = None, **coll: object
) -> Case:
    q = fx.build_quote(_PKI, tdx=tdx, **(quote or {}))  # type: ignore[arg-type]
    c = fx.build_collateral(_PKI, tdx=tdx, **coll)  # type: ignore[arg-type]
    return Case(f"synth:{name}", q, {"collateral_json": c}, fx.NOW, _PKI.root_der)


def _synth_cases() -> list[Case]:
    lvl, isv, tdx_tcb = fx.platform_level, fx.isv_level, fx.TDX_TCB
    higher = (6, 6, 2, 2, 3, 1, 0, 5) + (0,) * 8
    return [
        _synth("sgx_up_to_date"),
        _synth("tdx_up_to_date", tdx=True),
        _synth("sgx_v4", quote={"version": 4}),
        _synth("sgx_v5", quote={"version": 5}),
        _synth("tdx_v5_td15", tdx=True, quote={"version": 5, "td15": True}),
        _synth("sgx_sw_hardening", levels=[lvl("SWHardeningNeeded", advisories=("A-1",))]),
        _synth("sgx_config_needed", levels=[lvl("ConfigurationNeeded", advisories=("A-2",))]),
        _synth(
            "sgx_second_level",
            levels=[lvl("UpToDate", sgx=higher), lvl("OutOfDate", advisories=("A-3", "A-4"))],
        ),
        _synth("sgx_pce_svn_too_low", levels=[lvl("UpToDate", pce_svn=12)]),
        _synth("sgx_no_level", levels=[lvl("UpToDate", sgx=higher)]),
        _synth("sgx_revoked_level", levels=[lvl("Revoked", advisories=("A-5",))]),
        _synth(
            "sgx_qe_out_of_date",
            qe_levels=[isv("UpToDate", 9), isv("OutOfDate", 2, ("Q-1",))],
        ),
        _synth("sgx_qe_sw_hardening", qe_levels=[isv("SWHardeningNeeded", 8, ("Q-2",))]),
        _synth(
            "sgx_config_and_qe_out_of_date",
            levels=[lvl("ConfigurationAndSWHardeningNeeded", advisories=("A-6",))],
            qe_levels=[isv("UpToDate", 9), isv("OutOfDate", 1, ("Q-3",))],
        ),
        _synth("sgx_qe_revoked", qe_levels=[isv("Revoked", 1)]),
        _synth("sgx_revoked_pck", revoked_pck=(_PKI.pck.serial_number,)),
        _synth("sgx_revoked_other", revoked_pck=(99,)),
        _synth("sgx_fmspc_mismatch", fmspc=bytes(6)),
        _synth("sgx_tcb_info_expired", next_update=fx.NOW - timedelta(hours=1)),
        _synth(
            "sgx_tcb_info_future",
            issue=fx.NOW + timedelta(hours=1),
            next_update=fx.NOW + timedelta(days=9),
        ),
        _synth(
            "sgx_debug",
            quote={
                "body": fx.enclave_report(attributes=bytes([7]) + bytes(7) + b"\xe7" + bytes(7))
            },
        ),
        _synth(
            "tdx_debug",
            tdx=True,
            quote={"body": fx.td_report(td_attributes=bytes([1, 0, 0, 0x10, 0, 0, 0, 0]))},
        ),
        _synth(
            "tdx_level_by_tdx_components",
            tdx=True,
            levels=[
                lvl("UpToDate", tdx=(5, 0, 7) + (0,) * 13),
                lvl("OutOfDate", tdx=tdx_tcb, advisories=("T-1",)),
            ],
        ),
        _synth(
            "tdx_module_out_of_date",
            tdx=True,
            module_levels=[isv("UpToDate", 9), isv("OutOfDate", 2, ("M-1",))],
        ),
        _synth("tdx_module_below_all", tdx=True, module_levels=[isv("UpToDate", 9)]),
        _synth(
            "tdx_module_version_unknown",
            tdx=True,
            quote={"body": fx.td_report(tee_tcb_svn=bytes([6, 2, 3]) + bytes(13))},
        ),
        _synth(
            "tdx_module_version_zero",
            tdx=True,
            quote={"body": fx.td_report(tee_tcb_svn=bytes([6, 0, 3]) + bytes(13))},
            levels=[
                lvl("UpToDate", tdx=(7, 0, 2) + (0,) * 13),
                lvl("SWHardeningNeeded", tdx=(6, 0, 2) + (0,) * 13, advisories=("T-2",)),
            ],
        ),
        _synth("tdx_qe_out_of_date", tdx=True, qe_levels=[isv("UpToDate", 9)]),
        Case(
            "synth:sgx_quote_tdx_collateral",
            fx.build_quote(_PKI),
            {"collateral_json": fx.build_collateral(_PKI, tdx=True)},
            fx.NOW,
            _PKI.root_der,
        ),
        Case(
            "synth:tdx_quote_sgx_collateral",
            fx.build_quote(_PKI, tdx=True),
            {"collateral_json": fx.build_collateral(_PKI, levels=[_SGX_UP])},
            fx.NOW,
            _PKI.root_der,
        ),
    ]


CASES = _real_cases() + _synth_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_agrees_with_dcap_qvl(case: Case) -> None:
    ours, theirs = run_ours(case), run_qvl(case)
    assert ours.accepted == theirs.accepted, (ours, theirs)
    if ours.accepted:
        assert (ours.status, ours.advisories) == (theirs.status, theirs.advisories)


def test_expected_outcomes_on_real_vectors() -> None:
    """Guard the oracle itself: dcap-qvl gives the README's results."""
    sgx, v4, spr = (
        fx.vector(n) for n in ("sgx-dcap/dcapqvl_sgx_v3", "tdx/dcapqvl_v4", "tdx/gotdxguest_v4_spr")
    )
    assert run_qvl(Case("", sgx.quote, sgx.collateral, sgx.pin)) == Outcome(
        True, "ConfigurationAndSWHardeningNeeded", ("INTEL-SA-00289", "INTEL-SA-00615")
    )
    assert run_qvl(Case("", v4.quote, v4.collateral, v4.pin)) == Outcome(True, "UpToDate", ())
    assert not run_qvl(Case("", spr.quote, spr.collateral, spr.pin)).accepted


def _best(fn: Callable[[], object], n: int = 60) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_warm_verification_is_no_slower_than_dcap_qvl() -> None:
    v = fx.vector("tdx/dcapqvl_v4")
    ours = TdxVerifier(INTEL_ROOT)
    qvl_coll = to_qvl(v.collateral)
    now_s = int(v.pin.timestamp())
    ours.verify(v.quote, now=v.pin, collateral=v.collateral)  # warm the caches
    t_ours = _best(lambda: ours.verify(v.quote, now=v.pin, collateral=v.collateral))
    t_qvl = _best(lambda: dcap_qvl.verify(v.quote, qvl_coll, now_s))
    assert t_ours <= t_qvl, (t_ours, t_qvl)


def test_sgx_verifier_matches_core() -> None:
    v = fx.vector("sgx-dcap/dcapqvl_sgx_v3")
    claims = SgxVerifier(INTEL_ROOT).verify(
        v.quote, now=pin("2025-06-20T00:00:00Z"), collateral=v.collateral
    )
    assert run_ours(Case("", v.quote, v.collateral, v.pin)) == Outcome(
        True, claims.tcb_status, tuple(sorted(claims.advisories))
    )
