"""Continuous TCB re-evaluation end to end: a real control plane admits a TDX workload (quote
and collateral signed by the synthetic DCAP test root), the TCB monitor watches that
platform's collateral through the real PCS client and its on-disk cache, the "vendor" (a fake
PCS fetch serving the documents in their served form) publishes new collateral, and the
workload is re-appraised on record: audited, or quarantined after its grace period, without
re-attesting."""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

import tests.unit.evidence.dcap_fixtures as fx
from attestmesh.controlplane import ControlPlane
from attestmesh.metrics import Metrics
from attestmesh.tcb_monitor import TcbMonitor, build_tcb_monitor
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority
from certs.collateral.cache import DiskCache
from certs.collateral.intel_pcs import PcsCollateralSource, PcsResponse
from certs.collateral.roots import bundled_roots
from certs.errors import CollateralError
from certs.evidence.claims import Tee
from certs.evidence.dcap import DcapVerifier
from certs.evidence.tdx import TdxVerifier
from certs.issuance import AttestRequest
from certs.policy import parse_policies
from tests.unit.fixtures_core import (
    TRUST_DOMAIN,
    Clock,
    RecordingPublisher,
    csr_pem,
    new_key,
    policy_doc,
    registration,
    spki,
)
from xds.state import EventKind, Status, Trigger
from xds.store import SqliteStore, StateStore

BASE = "https://pcs.test"
OUT_OF_DATE = [
    fx.platform_level("UpToDate", tdx=(5, 0, 9) + (0,) * 13),
    fx.platform_level("OutOfDate", tdx=fx.TDX_TCB),
]


def _policy(**spec: Any) -> dict[str, Any]:
    return policy_doc(
        "tdx-pol", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}}, certificateTTL="24h",
        reattestationInterval="12h", **spec,
    )  # fmt: skip


@dataclass
class FakePcs:
    """Intel PCS as the client sees it: signed JSON bodies, URL-encoded issuer chain headers,
    DER CRLs. ``publish`` swaps in a new collateral set; ``down`` makes every fetch fail."""

    collateral: dict[str, Any]
    hits: Counter[str] = field(default_factory=Counter)
    down: bool = False

    def publish(self, collateral_json: bytes) -> None:
        self.collateral = json.loads(collateral_json)

    async def fetch(self, url: str) -> PcsResponse:
        path = urllib.parse.urlsplit(url).path
        self.hits[path] += 1
        if self.down:
            raise CollateralError("collateral_unreachable", f"{url}: connection refused")
        c = self.collateral

        def chain(name: str) -> str:
            return urllib.parse.quote(c[name])

        if path == "/tdx/certification/v4/tcb":
            body = f'{{"tcbInfo":{c["tcb_info"]},"signature":"{c["tcb_info_signature"]}"}}'
            return PcsResponse(
                body.encode(), {"tcb-info-issuer-chain": chain("tcb_info_issuer_chain")}
            )
        if path == "/tdx/certification/v4/qe/identity":
            body = (
                f'{{"enclaveIdentity":{c["qe_identity"]},'
                f'"signature":"{c["qe_identity_signature"]}"}}'
            )
            headers = {"sgx-enclave-identity-issuer-chain": chain("qe_identity_issuer_chain")}
            return PcsResponse(body.encode(), headers)
        if path == "/sgx/certification/v4/pckcrl":
            headers = {"sgx-pck-crl-issuer-chain": chain("pck_crl_issuer_chain")}
            return PcsResponse(bytes.fromhex(c["pck_crl"]), headers)
        if path == "/root.der":
            return PcsResponse(bytes.fromhex(c["root_ca_crl"]), {})
        raise CollateralError("collateral_http_status", f"{url}: HTTP 404")


@dataclass
class Env:
    pki: fx.Pki
    clock: Clock
    cp: ControlPlane
    metrics: Metrics
    pcs: FakePcs
    monitor: TcbMonitor
    store: StateStore

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)

    async def attest(self, name: str, collateral: bytes | None = None) -> None:
        key = new_key()
        nonce, _ = self.cp.challenge()
        body = fx.td_report(report_data=expected_report_data(nonce, spki(key)))
        quote = fx.build_quote(self.pki, tdx=True, body=body)
        coll = collateral if collateral is not None else fx.build_collateral(self.pki, tdx=True)
        req = AttestRequest(name, "tdx", quote, csr_pem(key), nonce, {"collateral_json": coll})
        await self.cp.attest(req, None)


def make_env(
    tmp_path: Path,
    policy: dict[str, Any],
    *,
    store: StateStore | None = None,
    like: Env | None = None,
) -> Env:
    """A control plane and its TCB monitor. ``like``: a restart of that one (same PKI, clock,
    vendor and collateral cache; ``store``: the database it opens again)."""
    pki = like.pki if like is not None else fx.Pki()
    clock = like.clock if like is not None else Clock(fx.NOW)
    metrics = Metrics()
    store = store if store is not None else SqliteStore(tmp_path / "state.db")
    cp = ControlPlane(
        state=store.load(TRUST_DOMAIN),
        store=store,
        ca=CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, clock()),
        verifiers={Tee.TDX: TdxVerifier(pki.root_der)},
        policies=parse_policies([policy]),
        mesh_policies=(),
        metrics=metrics,
        publisher=RecordingPublisher(),
        clock=clock,
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
    )
    cp.register([registration("web-1"), registration("web-2", port=15002)])
    pcs = like.pcs if like is not None else FakePcs(json.loads(fx.build_collateral(pki, tdx=True)))
    source = PcsCollateralSource(
        BASE, DiskCache(tmp_path / "collateral"), pcs.fetch,
        root_ca_crl_url=f"{BASE}/root.der", max_age=timedelta(hours=1),
    )  # fmt: skip
    monitor = TcbMonitor(
        cp, metrics, clock, intel=source, intel_verifier=DcapVerifier(pki.root_der),
        min_refresh=timedelta(seconds=30), max_refresh=timedelta(hours=1),
    )  # fmt: skip
    return Env(pki, clock, cp, metrics, pcs, monitor, store)


@pytest.fixture
def quarantining(tmp_path: Path) -> Env:
    return make_env(tmp_path, _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m"))


@pytest.fixture
def auditing(tmp_path: Path) -> Env:
    return make_env(tmp_path, _policy())


def _kinds(env: Env, name: str) -> list[tuple[EventKind, Trigger | None, str]]:
    return [(e.kind, e.trigger, e.reason) for e in env.cp.events(name)]


async def test_new_collateral_quarantines_after_the_grace_period(quarantining: Env) -> None:
    env = quarantining
    await env.attest("web-1")
    await env.attest("web-2")
    assert env.monitor.index.members(env.monitor.index.scopes()) == {"web-1", "web-2"}
    # the first refresh learns the collateral in force: the claims on record still pass
    assert await env.monitor.refresh() == []
    fetched = sum(env.pcs.hits.values())
    assert fetched == 4  # TCB info, QE identity, PCK CRL, root CA CRL: once each
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="admitted") == 0.0
    # Intel publishes a TCB recovery: this platform is OutOfDate now
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.clock.advance(minutes=5)
    assert await env.monitor.refresh() == []  # the cache is fresh: nothing fetched yet
    assert sum(env.pcs.hits.values()) == fetched
    assert env.cp.status_of("web-1") is Status.ATTESTED
    # the cache's max age passes: refetched, changed, re-appraised; quarantine deferred
    env.clock.advance(hours=1)
    assert await env.monitor.refresh() == []
    assert sum(env.pcs.hits.values()) == fetched + 4
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="deferred") == 2.0
    assert env.sample("attestmesh_tcb_collateral_refreshes_total", vendor="intel",
                      result="changed") == 2.0  # fmt: skip
    assert env.cp.status_of("web-1") is Status.ATTESTED
    (kind, trigger, reason) = _kinds(env, "web-1")[-1]
    assert kind is EventKind.AUDIT and trigger is Trigger.TCB_CHANGED
    assert "quarantine at" in reason and "tcb_status_not_accepted: OutOfDate" in reason
    # web-2 re-attests in time (its platform was patched: evidence under the fixed collateral
    # a later TCB info accepts), web-1 does not
    env.clock.advance(minutes=5)
    await env.attest("web-2")
    assert env.cp.check_deadlines() == []
    assert env.cp.status_of("web-1") is Status.ATTESTED  # 5 of 10 minutes gone
    env.clock.advance(minutes=6)
    env.cp.check_deadlines()
    assert env.cp.status_of("web-1") is Status.QUARANTINED
    assert env.cp.status_of("web-2") is Status.ATTESTED
    (kind, trigger, reason) = _kinds(env, "web-1")[-1]
    assert kind is EventKind.QUARANTINED and trigger is Trigger.TCB_CHANGED
    assert env.sample("attestmesh_quarantine_events_total", trigger="tcb_changed") == 1.0


async def test_collateral_that_moves_back_releases_the_deferred_quarantine(
    quarantining: Env,
) -> None:
    env = quarantining
    await env.attest("web-1")
    await env.monitor.refresh()
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.clock.advance(hours=1, seconds=1)
    await env.monitor.refresh()
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="deferred") == 1.0
    # Intel withdraws the change before the grace period is over
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, issue=fx.T0 + timedelta(days=1)))
    env.clock.advance(minutes=1)
    await env.monitor.refresh()  # cached: not seen yet
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="admitted") == 0.0
    env.clock.advance(hours=1)
    await env.monitor.refresh()
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="admitted") == 1.0
    env.clock.advance(minutes=30)
    assert env.cp.check_deadlines() == []
    assert env.cp.status_of("web-1") is Status.ATTESTED


async def test_audit_policy_records_a_revoked_pck_and_keeps_the_workload(auditing: Env) -> None:
    env = auditing
    await env.attest("web-1")
    await env.monitor.refresh()
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, revoked_pck=(0x1234,)))
    env.clock.advance(hours=1, seconds=1)
    assert await env.monitor.refresh() == []
    assert env.cp.status_of("web-1") is Status.ATTESTED
    (kind, trigger, reason) = _kinds(env, "web-1")[-1]
    assert kind is EventKind.AUDIT and trigger is Trigger.TCB_REVOKED
    assert reason == "tcb_changed: tcb_status_not_accepted: Revoked"
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="audit") == 1.0


async def test_unusable_collateral_changes_nothing(quarantining: Env) -> None:
    env = quarantining
    await env.attest("web-1")
    await env.monitor.refresh()
    in_force = env.monitor.collateral
    # the vendor is down and nothing fresh is cached: the collateral in force stays
    env.pcs.down = True
    env.clock.advance(hours=1, seconds=1)
    assert await env.monitor.refresh() == []
    assert env.monitor.collateral is in_force
    # the vendor serves collateral some other root signed: refused, counted, nothing changes
    env.pcs.down = False
    env.pcs.publish(fx.build_collateral(fx.Pki(), tdx=True, levels=OUT_OF_DATE))
    env.clock.advance(hours=1, seconds=1)
    assert await env.monitor.refresh() == []
    assert env.monitor.collateral is in_force
    assert env.sample("attestmesh_tcb_collateral_refreshes_total", vendor="intel",
                      result="invalid") == 1.0  # fmt: skip
    assert env.cp.status_of("web-1") is Status.ATTESTED
    assert [k for k, _, _ in _kinds(env, "web-1")].count(EventKind.AUDIT) == 0


async def test_the_schedule_follows_next_update_within_bounds(quarantining: Env) -> None:
    env = quarantining
    now = env.clock()
    assert env.monitor.next_refresh(now) == now + timedelta(hours=1)  # nothing known yet
    await env.attest("web-1")
    await env.monitor.refresh()
    # every document's nextUpdate is 30 days out: the upper bound decides
    assert env.monitor.next_refresh(env.clock()) == env.clock() + timedelta(hours=1)
    soon: datetime = env.clock() + timedelta(minutes=7)
    env.monitor._next_update[("intel-tcb", "tdx", "00906ed50000")] = soon
    assert env.monitor.next_refresh(env.clock()) == soon
    env.monitor._next_update[("intel-qe", "tdx")] = env.clock()
    assert env.monitor.next_refresh(env.clock()) == env.clock() + timedelta(seconds=30)


async def test_the_control_plane_watches_the_online_sources_it_has(quarantining: Env) -> None:
    env = quarantining
    roots = bundled_roots()
    assert build_tcb_monitor(env.cp, env.metrics, {}, roots, env.clock) is None
    pcs = PcsCollateralSource(BASE, DiskCache(Path("/nonexistent")), env.pcs.fetch)
    monitor = build_tcb_monitor(env.cp, env.metrics, {Tee.TDX: pcs, Tee.SGX: pcs}, roots,
                                env.clock)  # fmt: skip
    assert monitor is not None
    # anchored at the real Intel root: the test root's collateral does not verify there
    await env.attest("web-1")
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    monitor._intel = env.monitor._intel  # the same feed, through a cache that can be written
    assert await monitor.refresh() == []
    assert env.sample("attestmesh_tcb_collateral_refreshes_total", vendor="intel",
                      result="invalid") == 1.0  # fmt: skip


async def test_a_policy_raising_its_tcb_bar_follows_on_tcb_change(tmp_path: Path) -> None:
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    env = make_env(tmp_path, lenient)
    await env.attest("web-1", fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    record = env.cp.state.get("web-1").attestation
    assert record is not None and record.claims is not None
    assert record.claims.tcb_status == "OutOfDate"
    # the operator stops accepting OutOfDate: a TCB change, so the grace period applies
    env.cp.set_policies([_policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")])
    assert env.cp.status_of("web-1") is Status.ATTESTED
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="deferred") == 1.0
    env.clock.advance(minutes=11)
    env.cp.check_deadlines()
    assert env.cp.status_of("web-1") is Status.QUARANTINED
    assert _kinds(env, "web-1")[-1][1] is Trigger.TCB_CHANGED


# -- AMD: the product's CRL from KDS, signed by the (synthetic) ARK -----------------------------


async def test_an_amd_crl_revoking_the_ask_quarantines_snp_workloads(tmp_path: Path) -> None:
    from certs.collateral.amd_kds import KdsCollateralSource
    from certs.evidence.sev_snp import SevSnpVerifier, parse_amd_chain
    from tests.component.test_composite_attest import FakeCvm
    from tests.unit.evidence.test_sev_snp import _Amd

    amd = _Amd()
    chain = parse_amd_chain(amd.chain_pem())
    cvm = FakeCvm(amd)
    clock = Clock(fx.NOW)  # 2025-01-10: inside the synthetic AMD PKI's validity
    probe = SevSnpVerifier([chain]).verify(
        cvm.collect(bytes(64), nonce=b"", spki=b"").evidence, now=clock(),
        collateral={"vcek": cvm.vcek},
    )  # fmt: skip
    refs = {"sevSnp": {"measurement": [probe.measurements["measurement"]]}}
    doc = policy_doc("snp", tees=["sev-snp"], refs=refs, certificateTTL="24h",
                     reattestationInterval="12h", onTcbChange="quarantine")  # fmt: skip
    metrics = Metrics()
    store = SqliteStore(tmp_path / "state.db")
    cp = ControlPlane(
        state=store.load(TRUST_DOMAIN), store=store,
        ca=CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, clock()),
        verifiers={Tee.SEV_SNP: SevSnpVerifier([chain])}, policies=parse_policies([doc]),
        mesh_policies=(), metrics=metrics, publisher=RecordingPublisher(), clock=clock,
        serials=x509.random_serial_number, random_bytes=secrets.token_bytes,
    )  # fmt: skip
    cp.register([registration("web-1")])
    key = new_key()
    nonce, _ = cp.challenge()
    ev = cvm.collect(expected_report_data(nonce, spki(key)), nonce=nonce, spki=spki(key))
    await cp.attest(AttestRequest("web-1", "sev-snp", ev.evidence, csr_pem(key), nonce,
                                  dict(ev.collateral)), None)  # fmt: skip
    assert cp.status_of("web-1") is Status.ATTESTED
    served: dict[str, bytes] = {}
    hits: Counter[str] = Counter()

    async def fetch(url: str) -> bytes:
        hits[url] += 1
        if url not in served:
            raise CollateralError("collateral_http_status", f"{url}: HTTP 404")
        return served[url]

    crl_url = f"{BASE}/vcek/v1/Milan/crl"
    served[crl_url] = _amd_crl_at(amd, (77,), clock())  # nextUpdate: 7 days on
    kds = KdsCollateralSource(BASE, DiskCache(tmp_path / "kds"), fetch)
    monitor = TcbMonitor(cp, metrics, clock, amd=kds, amd_chains=[chain])
    assert monitor.index.scopes() == [("amd-crl", "Milan")]
    assert await monitor.refresh() == []
    assert hits[crl_url] == 1 and cp.status_of("web-1") is Status.ATTESTED
    # AMD revokes the ASK (serial 1 in the synthetic PKI); the cached CRL is fresh until its
    # nextUpdate, so the change is seen when the schedule comes round
    served[crl_url] = _amd_crl_at(amd, (1,), clock())
    clock.advance(days=6)
    assert await monitor.refresh() == [] and hits[crl_url] == 1  # before nextUpdate
    assert monitor.next_refresh(clock()) == clock() + timedelta(hours=1)
    clock.advance(days=1, seconds=1)
    served[crl_url] = _amd_crl_at(amd, (1,), clock())  # KDS's current CRL
    assert await monitor.refresh() == ["web-1"]
    assert cp.status_of("web-1") is Status.QUARANTINED
    (kind, trigger, _) = [(e.kind, e.trigger, e.reason) for e in cp.events("web-1")][-1]
    assert kind is EventKind.QUARANTINED and trigger is Trigger.TCB_REVOKED


def _amd_crl_at(amd: Any, revoked: tuple[int, ...], now: datetime) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.serialization import Encoding

    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(amd.ark.subject)
        .last_update(now - timedelta(hours=1))
        .next_update(now + timedelta(days=7))
    )
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    return builder.sign(amd.ark_key, hashes.SHA384(), rsa_padding=amd.PSS).public_bytes(
        Encoding.DER
    )


async def test_the_monitor_loop_refreshes_and_stops(quarantining: Env) -> None:
    env = quarantining
    await env.attest("web-1")
    stop = asyncio.Event()
    task = asyncio.create_task(env.monitor.run(stop))
    for _ in range(100):  # the first refresh runs at once
        if sum(env.pcs.hits.values()) >= 4:
            break
        await asyncio.sleep(0.02)
    assert sum(env.pcs.hits.values()) == 4
    stop.set()
    await asyncio.wait_for(task, 5)
    assert task.done() and task.exception() is None


# -- deferred quarantines are durable; a policy that admits again drops them -------------------


def _deferrals(env: Env, name: str) -> list[str]:
    return [r for k, _, r in _kinds(env, name) if k is EventKind.AUDIT and "quarantine at" in r]


async def test_a_deferred_quarantine_keeps_its_deadline_across_a_restart(tmp_path: Path) -> None:
    policy = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    env = make_env(tmp_path, policy)
    await env.attest("web-1")
    await env.monitor.refresh()
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.clock.advance(hours=1, seconds=1)
    await env.monitor.refresh()
    deadline = env.clock() + timedelta(minutes=10)
    stored = env.store.load(TRUST_DOMAIN).get("web-1").tcb_deferral
    assert stored is not None and stored.due == deadline  # in the row, on disk
    assert stored.code == "tcb_status_not_accepted" and not stored.revoked
    env.store.close()
    # 8 minutes later the control plane restarts on the same database; its monitor starts
    # afresh (no collateral seen yet), re-appraises and finds the same: the deadline holds
    env.clock.advance(minutes=8)
    again = make_env(tmp_path, policy, store=SqliteStore(tmp_path / "state.db"), like=env)
    assert await again.monitor.refresh() == []
    assert again.sample("attestmesh_tcb_reappraisals_total", outcome="deferred") == 1.0
    assert again.cp.state.get("web-1").tcb_deferral == stored
    assert len(_deferrals(again, "web-1")) == 1  # announced once, before the restart
    again.clock.advance(minutes=1, seconds=59)
    assert again.cp.check_deadlines() == []
    assert again.cp.status_of("web-1") is Status.ATTESTED
    again.clock.advance(seconds=1)  # the original deadline, not 10 minutes after the restart
    again.cp.check_deadlines()
    assert again.cp.status_of("web-1") is Status.QUARANTINED
    (kind, trigger, reason) = _kinds(again, "web-1")[-1]
    assert kind is EventKind.QUARANTINED and trigger is Trigger.TCB_CHANGED
    assert "OutOfDate" in reason
    assert again.cp.state.get("web-1").tcb_deferral is None  # spent


async def test_a_restart_without_the_monitor_still_quarantines_at_the_deadline(
    tmp_path: Path,
) -> None:
    """The deadline comes from the stored row alone (no re-appraisal after the restart)."""
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    strict = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    env = make_env(tmp_path, lenient)
    await env.attest("web-1", fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.cp.set_policies([strict])
    env.store.close()
    env.clock.advance(minutes=9)
    again = make_env(tmp_path, strict, store=SqliteStore(tmp_path / "state.db"), like=env)
    assert again.cp.check_deadlines() == [] and again.cp.status_of("web-1") is Status.ATTESTED
    again.clock.advance(minutes=1)
    again.cp.check_deadlines()
    assert again.cp.status_of("web-1") is Status.QUARANTINED


async def test_a_re_attestation_clears_the_stored_deferral(tmp_path: Path) -> None:
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    env = make_env(tmp_path, lenient)
    await env.attest("web-1", fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.cp.set_policies([_policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")])
    assert env.store.load(TRUST_DOMAIN).get("web-1").tcb_deferral is not None
    env.clock.advance(minutes=5)
    await env.attest("web-1")  # patched: UpToDate evidence
    assert env.store.load(TRUST_DOMAIN).get("web-1").tcb_deferral is None
    env.clock.advance(minutes=6)
    assert env.cp.check_deadlines() == []
    assert env.cp.status_of("web-1") is Status.ATTESTED


async def test_a_policy_admitting_the_workload_again_drops_its_deferred_quarantine(
    tmp_path: Path,
) -> None:
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    env = make_env(tmp_path, lenient)
    await env.attest("web-1", fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.cp.set_policies([_policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")])
    assert env.cp.state.get("web-1").tcb_deferral is not None
    # the operator takes the stricter bar back before the grace period is over
    env.clock.advance(minutes=3)
    env.cp.set_policies([lenient])
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="admitted") == 1.0
    assert env.cp.state.get("web-1").tcb_deferral is None
    assert env.store.load(TRUST_DOMAIN).get("web-1").tcb_deferral is None
    env.clock.advance(minutes=30)
    assert env.cp.check_deadlines() == []
    assert env.cp.status_of("web-1") is Status.ATTESTED
    # and the bar raised again starts a new grace period from now
    env.cp.set_policies([_policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")])
    d = env.cp.state.get("web-1").tcb_deferral
    assert d is not None and d.due == env.clock() + timedelta(minutes=10)


async def test_a_policy_reload_keeps_a_deferral_made_on_new_collateral(quarantining: Env) -> None:
    """The claims on record predate the new collateral (they say UpToDate): a reload of the
    same policy re-appraises them as the collateral in force evaluates them, so the monitor's
    deferred quarantine is not dropped."""
    env = quarantining
    await env.attest("web-1")
    await env.monitor.refresh()
    env.pcs.publish(fx.build_collateral(env.pki, tdx=True, levels=OUT_OF_DATE))
    env.clock.advance(hours=1, seconds=1)
    await env.monitor.refresh()
    due = env.cp.state.get("web-1").tcb_deferral
    record = env.cp.state.get("web-1").attestation
    assert due is not None and record is not None and record.claims is not None
    assert record.claims.tcb_status == "UpToDate"
    env.clock.advance(minutes=2)
    env.cp.set_policies([_policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")])
    assert env.cp.state.get("web-1").tcb_deferral == due  # same deadline, not dropped
    assert env.sample("attestmesh_tcb_reappraisals_total", outcome="admitted") == 0.0
    env.clock.advance(minutes=8)
    env.cp.check_deadlines()
    assert env.cp.status_of("web-1") is Status.QUARANTINED
