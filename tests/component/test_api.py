"""The attestation API end to end in-process: aiohttp test server on loopback, a real
ControlPlane over SqliteStore + CertificateAuthority in tmp_path, the sim verifier with a
generated platform key, and a recording publisher."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import crypto

from attestmesh.controlplane.http import build_app
from certs.binding import expected_report_data
from certs.ca import BACKDATE, CLAIMS_OID, decode_claims_extension
from certs.ear import TrustTier, verify_certificate_ear
from certs.errors import CollateralError, EvidenceVerificationError, PolicyError
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier
from certs.nonces import NonceBook
from sidecar.agent import SimEvidenceSource
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    Plane,
    csr_pem,
    make_control_plane,
    new_key,
    policy_doc,
    registration,
    spki,
)
from xds.state import EventKind, Status, Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
WEB_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
TOKEN = "s3cret-join-token"
REGISTRATIONS = [
    registration("web-1"),
    registration("api-1", service_account="api"),  # no policy governs it
    registration("tok-1", token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest()),
]
POLICY = policy_doc(certificateTTL="1h", reattestationInterval="30m")


@dataclass
class Env:
    plane: Plane
    client: TestClient[Any, Any]
    clock: Clock
    tmp: Path

    @property
    def cp(self) -> Any:
        return self.plane.cp


@pytest.fixture
def clock() -> Clock:
    return Clock(NOW)


@contextlib.asynccontextmanager
async def _env(tmp: Path, clock: Clock, **kwargs: Any) -> AsyncIterator[Env]:
    kwargs.setdefault("policies", [POLICY])
    plane = make_control_plane(
        tmp, clock=clock, platform_key=PLATFORM, registrations=REGISTRATIONS, **kwargs
    )
    try:
        async with TestClient(
            TestServer(build_app(plane.cp, plane.metrics), host="127.0.0.1")
        ) as c:
            yield Env(plane, c, clock, tmp)
    finally:
        plane.store.close()


@pytest.fixture
async def env(tmp_path: Path, clock: Clock) -> AsyncIterator[Env]:
    async with _env(tmp_path, clock) as e:
        yield e


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    nonce: bytes
    key: ec.EllipticCurvePrivateKey


async def challenge(env: Env) -> bytes:
    resp = await env.client.post("/v1/challenge")
    assert resp.status == 200
    body = await resp.json()
    assert set(body) == {"nonce", "expires_at"}
    return base64.b64decode(body["nonce"])


async def attest(
    env: Env,
    workload: str = "web-1",
    *,
    path: str = "/v1/attest",
    nonce: bytes | None = None,
    key: ec.EllipticCurvePrivateKey | None = None,
    bind_key: ec.EllipticCurvePrivateKey | None = None,
    measurement: bytes = MEASUREMENT,
    platform: ec.EllipticCurvePrivateKey = PLATFORM,
    override: dict[str, Any] | None = None,
    token: str | None = None,
) -> Reply:
    nonce = await challenge(env) if nonce is None else nonce
    key = key or new_key()
    bound = spki(bind_key or key)
    evidence = SimEvidenceSource(platform, measurement).collect(
        expected_report_data(nonce, bound), nonce=nonce, spki=bound
    )
    body: dict[str, Any] = {
        "workload": workload,
        "tee": evidence.tee,
        "evidence": base64.b64encode(evidence.evidence).decode(),
        "csr": csr_pem(key).decode(),
        "nonce": base64.b64encode(nonce).decode(),
    }
    body.update(override or {})
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    resp = await env.client.post(path, json=body, headers=headers)
    return Reply(resp.status, await resp.json(), nonce, key)


def assert_refused(
    env: Env, reply: Reply, status: int, reason: str, *, endpoint: str = "attest"
) -> None:
    """A clear 4xx with a machine-readable reason, counted, and no certificate."""
    assert (reply.status, reply.body.get("error")) == (status, reason), reply.body
    assert set(reply.body) == {"error", "detail"} and reply.body["detail"]
    assert env.plane.rejections(endpoint, reason) == 1.0
    assert env.plane.issued == 0.0


def leaf_of(reply: Reply) -> x509.Certificate:
    return x509.load_pem_x509_certificates(reply.body["certificate_chain"].encode())[0]


# ---------------------------------------------------------------------------------------------
# the happy path


async def test_challenge_then_attest_issues_a_verifiable_certificate(env: Env) -> None:
    reply = await attest(env)
    assert reply.status == 200, reply.body
    chain = x509.load_pem_x509_certificates(reply.body["certificate_chain"].encode())
    leaf, intermediate = chain
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [WEB_ID]
    assert reply.body["spiffe_id"] == WEB_ID
    assert leaf.public_key() == reply.key.public_key()
    assert str(leaf.serial_number) == reply.body["serial"]
    assert leaf.not_valid_after_utc.isoformat() == reply.body["not_after"]
    assert reply.body["not_after"] == (NOW + timedelta(hours=1)).isoformat()
    assert reply.body["renew_after"] == (NOW + timedelta(minutes=30)).isoformat()
    assert reply.body["reattest_by"] == (NOW + timedelta(minutes=30)).isoformat()
    claims = decode_claims_extension(
        leaf.extensions.get_extension_for_oid(CLAIMS_OID).value.value  # type: ignore[attr-defined]
    )
    assert claims["tee"] == "sim" and claims["measurements"] == {"measurement": MEASUREMENT.hex()}
    assert claims["policy"] == "default/pol"
    # the same result in standard form: an EAR the issuing intermediate signed, about this leaf
    ear = verify_certificate_ear(leaf, intermediate, WEB_ID)
    assert ear.submods["sim"]["ear.appraisal-policy-id"] == "default/pol"
    assert ear.claims["iat"] == int(NOW.timestamp()) and ear.status is TrustTier.WARNING
    # OpenSSL path validation against the trust bundle the API returned
    root = x509.load_pem_x509_certificate(reply.body["trust_bundle"].encode())
    assert root.fingerprint(hashes.SHA256()) == env.plane.ca.root.fingerprint(hashes.SHA256())
    store = crypto.X509Store()
    store.add_cert(crypto.X509.from_cryptography(root))
    store.set_time(NOW)
    crypto.X509StoreContext(
        store,
        crypto.X509.from_cryptography(leaf),
        [crypto.X509.from_cryptography(intermediate)],
    ).verify_certificate()
    # state, persistence, announcement, metrics
    assert env.cp.status_of("web-1") is Status.ATTESTED
    assert env.plane.store.load(TRUST_DOMAIN).get("web-1").status is Status.ATTESTED
    assert env.plane.publisher.last_state.get("web-1").status is Status.ATTESTED
    assert [e.kind for e in env.plane.publisher.events][-1] is EventKind.ATTESTED
    assert env.plane.issued == 1.0
    assert (
        env.plane.sample("attestmesh_attestations_total", tee="sim", result="admitted", reason="ok")
        == 1.0
    )


async def test_trust_endpoint_serves_bundle_and_crl(env: Env) -> None:
    resp = await env.client.get("/v1/trust")
    body = await resp.json()
    assert resp.status == 200
    assert body["trust_bundle"].encode() == env.plane.ca.bundle_pem
    crl = x509.load_pem_x509_crl(body["crl"].encode())
    assert crl.is_signature_valid(env.plane.ca.intermediate.cert.public_key())  # type: ignore[arg-type]
    assert len(crl) == 0


async def test_renew_of_an_attested_workload_issues_a_new_certificate(env: Env) -> None:
    first = await attest(env)
    renewed = await attest(env, path="/v1/renew")
    assert renewed.status == 200, renewed.body
    assert renewed.body["serial"] != first.body["serial"]
    assert leaf_of(renewed).public_key() == renewed.key.public_key()
    live = env.cp.state.get("web-1").certificates
    assert [str(c.serial) for c in live] == [first.body["serial"], renewed.body["serial"]]


# ---------------------------------------------------------------------------------------------
# bad input: a clear 4xx, a reason, a metric, no certificate


async def test_malformed_json(env: Env) -> None:
    resp = await env.client.post("/v1/attest", data=b"{not json")
    reply = Reply(resp.status, await resp.json(), b"", new_key())
    assert_refused(env, reply, 400, "request_malformed")


@pytest.mark.parametrize(
    "override",
    [
        {"evidence": "***not base64***"},
        {"nonce": "YQ"},  # missing padding
        {"evidence": 5},
        {"workload": ""},
        {"csr": None},
        {"collateral": ["x"]},
        {"collateral": {"vcek": "%%%"}},
        {"collateral": {f"c{i}": "" for i in range(17)}},
    ],
    ids=lambda o: next(iter(o)),
)
async def test_malformed_fields(env: Env, override: dict[str, Any]) -> None:
    assert_refused(env, await attest(env, override=override), 400, "request_malformed")


async def test_body_that_is_not_an_object(env: Env) -> None:
    resp = await env.client.post("/v1/attest", json=["web-1"])
    assert_refused(
        env, Reply(resp.status, await resp.json(), b"", new_key()), 400, "request_malformed"
    )


async def test_truncated_evidence(env: Env) -> None:
    nonce = await challenge(env)
    key = new_key()
    full = SimEvidenceSource(PLATFORM, MEASUREMENT).collect(
        expected_report_data(nonce, spki(key)), nonce=nonce, spki=spki(key)
    )
    truncated = base64.b64encode(full.evidence[:-10]).decode()
    reply = await attest(env, nonce=nonce, key=key, override={"evidence": truncated})
    assert_refused(env, reply, 403, "truncated")
    assert (
        env.plane.sample(
            "attestmesh_attestations_total", tee="sim", result="rejected", reason="truncated"
        )
        == 1.0
    )


async def test_bad_csr(env: Env) -> None:
    reply = await attest(env, override={"csr": "-----BEGIN CERTIFICATE REQUEST-----\nAA==\n"})
    assert_refused(env, reply, 400, "csr_malformed")


async def test_csr_key_type(env: Env) -> None:
    p384 = ec.generate_private_key(ec.SECP384R1())
    reply = await attest(env, override={"csr": csr_pem(p384).decode()})
    assert_refused(env, reply, 400, "csr_key_type")


async def test_csr_key_other_than_the_bound_key(env: Env) -> None:
    reply = await attest(env, bind_key=new_key())
    assert_refused(env, reply, 403, "binding_mismatch")


async def test_replayed_nonce(env: Env) -> None:
    first = await attest(env)
    assert first.status == 200
    replay = await attest(env, nonce=first.nonce)
    assert (replay.status, replay.body["error"]) == (400, "nonce_reused")
    assert env.plane.rejections("attest", "nonce_reused") == 1.0
    assert env.plane.issued == 1.0  # only the first
    assert env.cp.status_of("web-1") is Status.ATTESTED  # request errors never quarantine


async def test_expired_nonce(env: Env) -> None:
    nonce = await challenge(env)
    env.clock.advance(seconds=61)
    assert_refused(env, await attest(env, nonce=nonce), 400, "nonce_expired")


async def test_unknown_nonce(env: Env) -> None:
    assert_refused(env, await attest(env, nonce=bytes(32)), 400, "nonce_unknown")


async def test_unknown_workload_and_bad_credentials_answer_alike(env: Env) -> None:
    # names cannot be enumerated: the answers are identical, the metrics keep them apart
    ghost = await attest(env, "ghost")
    wrong = await attest(env, "tok-1", token="wrong")
    missing = await attest(env, "tok-1")
    for reply in (ghost, wrong, missing):
        assert (reply.status, reply.body) == (
            401,
            {"error": "identity_invalid", "detail": "unknown workload or bad credentials"},
        )
    assert env.plane.rejections("attest", "unknown_identity") == 1.0
    assert env.plane.rejections("attest", "identity_invalid") == 2.0
    assert env.plane.issued == 0.0
    assert (await attest(env, "tok-1", token=TOKEN)).status == 200


async def test_renew_checks_identity_before_telling_not_attested(env: Env) -> None:
    # before the fix renew answered 409 for a pending workload and 404 for an unknown one,
    # before any identity check: an oracle. Now whoever cannot prove to be the workload hears
    # the same 401, pending or attested; only the workload itself hears 409 not_attested.
    uniform = (401, {"error": "identity_invalid", "detail": "unknown workload or bad credentials"})
    replies = [
        await attest(env, "ghost", path="/v1/renew"),
        await attest(env, "tok-1", path="/v1/renew", token="wrong"),  # pending, bad token
        await attest(env, "tok-1", path="/v1/renew"),  # pending, no token
    ]
    assert (await attest(env, "tok-1", token=TOKEN)).status == 200  # now attested
    replies.append(await attest(env, "tok-1", path="/v1/renew", token="wrong"))
    assert [(r.status, r.body) for r in replies] == [uniform] * 4
    assert env.plane.rejections("renew", "unknown_identity") == 1.0
    assert env.plane.rejections("renew", "identity_invalid") == 3.0
    assert env.cp.status_of("tok-1") is Status.ATTESTED  # refusals change nothing
    assert (await attest(env, "tok-1", path="/v1/renew", token=TOKEN)).status == 200
    # the workload itself, pending, is told to attest
    reply = await attest(env, "web-1", path="/v1/renew")
    assert (reply.status, reply.body["error"]) == (409, "not_attested")


async def test_no_governing_policy(env: Env) -> None:
    assert_refused(env, await attest(env, "api-1"), 403, "no_policy")
    assert env.cp.status_of("api-1") is Status.PENDING


async def test_disallowed_measurement(env: Env) -> None:
    reply = await attest(env, measurement=OTHER_MEASUREMENT)
    assert_refused(env, reply, 403, "measurement_not_allowed")
    assert env.cp.status_of("web-1") is Status.PENDING  # a first failure does not quarantine


async def test_wrong_platform_key(env: Env) -> None:
    reply = await attest(env, platform=new_key())
    assert_refused(env, reply, 403, "signature_invalid")


async def test_sim_refused_when_the_policy_does_not_name_it(tmp_path: Path, clock: Clock) -> None:
    tdx_only = policy_doc(tees=["tdx"], refs={"tdx": {"mrtd": ["aa" * 48]}})
    async with _env(tmp_path, clock, policies=[tdx_only]) as env:
        assert_refused(env, await attest(env), 403, "tee_not_allowed")


async def test_sim_refused_without_a_sim_verifier(tmp_path: Path, clock: Clock) -> None:
    async with _env(tmp_path, clock, sim=False) as env:
        assert_refused(env, await attest(env), 403, "tee_not_supported")


async def test_renew_needs_an_attested_workload(env: Env) -> None:
    reply = await attest(env, path="/v1/renew")
    assert_refused(env, reply, 409, "not_attested", endpoint="renew")


async def test_a_challenge_flood_exhausts_nothing(env: Env) -> None:
    # before: 64 outstanding challenges per remote address, so one loopback/NAT neighbour
    # starved everyone. Now a nonce is authenticated and stateless: issuing keeps nothing.
    for _ in range(2_000):
        await challenge(env)
    assert env.cp._nonces.consumed == 0
    reply = await attest(env)
    assert reply.status == 200, reply.body
    assert env.plane.rejections("challenge", "too_many_challenges") == 0.0


async def test_forged_nonce_is_unknown(env: Env) -> None:
    nonce = bytearray(await challenge(env))
    nonce[20] ^= 1  # push the expiry: the MAC no longer matches
    assert_refused(env, await attest(env, nonce=bytes(nonce)), 400, "nonce_unknown")


async def test_a_full_replay_set_is_503_retry_later(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(env.cp, "_nonces", NonceBook(max_consumed=1))
    assert (await attest(env)).status == 200
    reply = await attest(env, "tok-1", token=TOKEN)
    assert (reply.status, reply.body["error"]) == (503, "nonce_capacity")
    assert env.plane.rejections("attest", "nonce_capacity") == 1.0
    assert env.cp.status_of("tok-1") is Status.PENDING
    env.clock.advance(seconds=61)  # the first nonce expired and left the replay set
    assert (await attest(env, "tok-1", token=TOKEN)).status == 200


async def test_a_workload_attesting_too_often_is_429(env: Env) -> None:
    for _ in range(8):  # the control plane's burst per workload
        assert (await attest(env)).status == 200
    reply = await attest(env)
    assert (reply.status, reply.body["error"]) == (429, "too_many_attestations")
    assert env.plane.rejections("attest", "too_many_attestations") == 1.0


async def test_deeply_nested_json_is_malformed_not_a_server_error(env: Env) -> None:
    depth = 200_000
    for path in ("/v1/attest", "/v1/renew"):
        resp = await env.client.post(path, data=b"[" * depth + b"]" * depth)
        body = await resp.json()
        assert (resp.status, body["error"]) == (400, "request_malformed"), body
    assert env.plane.rejections("attest", "request_malformed") == 1.0


async def test_csr_that_is_not_ascii_is_malformed_not_a_server_error(env: Env) -> None:
    reply = await attest(env, override={"csr": "\ud800"})  # a lone surrogate
    assert_refused(env, reply, 400, "request_malformed")


async def test_audit_only_policy_admits_nothing(tmp_path: Path, clock: Clock) -> None:
    # before: a workload governed only by an audit-mode policy was admitted whatever it showed
    async with _env(tmp_path, clock, policies=[policy_doc(mode="audit", allowDebug=True)]) as env:
        assert_refused(env, await attest(env), 403, "no_enforcing_policy")
        reply = await attest(env, measurement=OTHER_MEASUREMENT)
        assert (reply.status, reply.body["error"]) == (403, "no_enforcing_policy")
        assert env.cp.status_of("web-1") is Status.PENDING


async def test_policy_change_to_audit_only_quarantines_a_running_workload(env: Env) -> None:
    assert (await attest(env)).status == 200
    env.cp.set_policies([policy_doc(mode="audit")])
    w = env.cp.state.get("web-1")
    assert w.status is Status.QUARANTINED
    assert w.quarantine.trigger is Trigger.POLICY_CHANGED
    assert w.quarantine.reason.startswith("no_enforcing_policy")


async def test_oversized_body_is_refused(env: Env) -> None:
    resp = await env.client.post("/v1/attest", data=io.BytesIO(b"x" * ((1 << 20) + 1)))
    assert resp.status == 413
    assert env.plane.issued == 0.0


# ---------------------------------------------------------------------------------------------
# quarantine


async def test_failed_re_attestation_quarantines(env: Env) -> None:
    first = await attest(env)
    serial = int(first.body["serial"])
    failed = await attest(env, path="/v1/renew", measurement=OTHER_MEASUREMENT)
    assert (failed.status, failed.body["error"]) == (403, "measurement_not_allowed")
    w = env.cp.state.get("web-1")
    assert w.status is Status.QUARANTINED
    assert w.quarantine.trigger is Trigger.APPRAISAL_FAILED
    # persisted, then announced with the revocation
    assert env.plane.store.load(TRUST_DOMAIN).revoked_serials() == {serial}
    assert env.plane.publisher.last_state.revoked_serials() == {serial}
    crl = x509.load_pem_x509_crl(env.plane.publisher.last_trust.crl_pem)
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    assert env.plane.publisher.events[-1].kind is EventKind.QUARANTINED
    assert env.plane.sample("attestmesh_quarantine_events_total", trigger="appraisal_failed") == 1.0
    assert env.plane.sample("attestmesh_quarantined_workloads") == 1.0
    # no certificate for it any more, whatever it sends
    again = await attest(env)
    assert (again.status, again.body["error"]) == (403, "quarantined")
    renew = await attest(env, path="/v1/renew")
    assert renew.status == 403
    assert env.plane.issued == 1.0


async def test_unverifiable_evidence_is_refused_and_quarantines_nothing(env: Env) -> None:
    """Only authentic evidence may accuse: a forged report (not signed by a platform key) is a
    refused request, counted and recorded, and the attested workload stays attested."""
    assert (await attest(env)).status == 200
    failed = await attest(env, path="/v1/renew", platform=new_key())
    assert (failed.status, failed.body["error"]) == (403, "signature_invalid")
    w = env.cp.state.get("web-1")
    assert w.status is Status.ATTESTED and w.quarantine is None
    refused = [e for e in env.cp.events("web-1") if e.kind is EventKind.REFUSED]
    assert [(e.code, e.trigger) for e in refused] == [
        ("signature_invalid", Trigger.VERIFICATION_FAILED)
    ]
    assert (await attest(env, path="/v1/renew")).status == 200


class _RevokingVerifier:
    """The sim verifier until told that the platform's TCB was revoked."""

    def __init__(self) -> None:
        self.inner = SimVerifier([PLATFORM.public_key()])
        self.revoked = False

    @property
    def tee(self) -> Tee:
        return Tee.SIM

    def verify(self, evidence: bytes, *, now: Any, collateral: Any) -> Any:
        if self.revoked:
            raise EvidenceVerificationError("revoked", "platform TCB revoked")
        return self.inner.verify(evidence, now=now, collateral=collateral)


async def test_a_revoked_chain_is_refused_not_a_quarantine(env: Env) -> None:
    verifier = _RevokingVerifier()
    env.cp._verifiers[Tee.SIM] = verifier
    assert (await attest(env)).status == 200
    verifier.revoked = True
    assert (await attest(env, path="/v1/renew")).body["error"] == "revoked"
    assert env.cp.state.get("web-1").status is Status.ATTESTED


class _TcbVerifier:
    """The sim verifier, reporting the TCB status vendor collateral gives the platform."""

    def __init__(self) -> None:
        self.inner = SimVerifier([PLATFORM.public_key()])
        self.status = "UpToDate"

    @property
    def tee(self) -> Tee:
        return Tee.SIM

    def verify(self, evidence: bytes, *, now: Any, collateral: Any) -> Any:
        claims = self.inner.verify(evidence, now=now, collateral=collateral)
        return replace(claims, tcb_status=self.status)


async def test_authentic_evidence_of_a_revoked_tcb_quarantines_and_indicts_the_platform(
    env: Env,
) -> None:
    verifier = _TcbVerifier()
    env.cp._verifiers[Tee.SIM] = verifier
    assert (await attest(env)).status == 200
    verifier.status = "Revoked"
    reply = await attest(env, path="/v1/renew")
    assert (reply.status, reply.body["error"]) == (403, "tcb_status_not_accepted")
    q = env.cp.state.get("web-1").quarantine
    assert q is not None
    assert (q.trigger, q.code, q.platform) == (
        Trigger.TCB_REVOKED,
        "tcb_status_not_accepted",
        True,
    )


class _CollateralService:
    """A vendor collateral service for the sim TEE that can fail on demand."""

    def __init__(self) -> None:
        self.failure: CollateralError | None = None

    async def collateral_for(self, evidence: bytes, supplied: Any, now: Any) -> dict[str, bytes]:
        if self.failure is not None:
            raise self.failure
        return dict(supplied)


@pytest.mark.parametrize("reason", ["collateral_unreachable", "collateral_http_status"])
async def test_collateral_outage_fails_the_request_but_never_quarantines(
    tmp_path: Path, clock: Clock, reason: str
) -> None:
    service = _CollateralService()
    async with _env(tmp_path, clock, collateral_sources={Tee.SIM: service}) as env:
        assert (await attest(env)).status == 200
        service.failure = CollateralError(reason, "https://kds.example: down")
        reply = await attest(env, path="/v1/renew")
        assert (reply.status, reply.body["error"]) == (503, reason)
        assert env.cp.status_of("web-1") is Status.ATTESTED
        assert env.plane.rejections("renew", reason) == 1.0
        assert (
            env.plane.sample(
                "attestmesh_attestations_total", tee="sim", result="error", reason=reason
            )
            == 1.0
        )
        service.failure = None
        assert (await attest(env, path="/v1/renew")).status == 200


async def test_collateral_the_evidence_cannot_have_counts_against_the_workload(
    tmp_path: Path, clock: Clock
) -> None:
    service = _CollateralService()
    async with _env(tmp_path, clock, collateral_sources={Tee.SIM: service}) as env:
        assert (await attest(env)).status == 200
        service.failure = CollateralError("collateral_missing", "report has no signing key")
        reply = await attest(env, path="/v1/renew")
        assert (reply.status, reply.body["error"]) == (403, "collateral_missing")
        # refused (the evidence could not be verified), but it accuses nobody
        assert env.cp.status_of("web-1") is Status.ATTESTED
        assert [e.code for e in env.cp.events("web-1") if e.kind is EventKind.REFUSED] == [
            "collateral_missing"
        ]


async def test_release_then_fresh_attestation(env: Env) -> None:
    await attest(env)
    await attest(env, path="/v1/renew", measurement=OTHER_MEASUREMENT)
    assert env.cp.release("web-1")
    assert not env.cp.release("web-1")
    assert env.cp.status_of("web-1") is Status.PENDING
    assert env.plane.publisher.events[-1].kind is EventKind.RELEASED
    renew = await attest(env, path="/v1/renew")
    assert (renew.status, renew.body["error"]) == (409, "not_attested")
    fresh = await attest(env)
    assert fresh.status == 200
    assert env.cp.status_of("web-1") is Status.ATTESTED


async def test_invalid_policy_reload_keeps_the_previous_policy(env: Env) -> None:
    bad_a = policy_doc("a", tees=["quantum"], surprise=1)
    bad_b = policy_doc("b", certificateTTL="2d")
    with pytest.raises(PolicyError) as info:
        env.cp.set_policies([bad_a, bad_b])
    assert info.value.problems == [
        "a.spec.surprise: unknown field (allowed: allowDebug, allowedTees, certificateTTL, "
        "mode, onFailure, onTcbChange, reattestationInterval, referenceValues, requires, "
        "selector, tcbChangeGracePeriod)",
        "a.spec.allowedTees: unknown TEE 'quantum' (one of sim, nitro, sev-snp, tdx, sgx, "
        "nvidia-gpu)",
        "b.spec.certificateTTL: invalid duration '2d' (use e.g. 90s, 10m, 1h30m)",
    ]
    assert env.plane.sample("attestmesh_policy_reloads_total", result="invalid") == 1.0
    reply = await attest(env)
    assert reply.status == 200  # the previous policy is still in force
    assert leaf_of(reply).not_valid_after_utc == NOW + timedelta(hours=1)


async def test_policy_change_quarantines_a_workload_it_no_longer_admits(env: Env) -> None:
    assert (await attest(env)).status == 200
    assert (await attest(env, "tok-1", token=TOKEN)).status == 200
    stricter = policy_doc(refs={"sim": {"measurement": [OTHER_MEASUREMENT.hex()]}})
    env.cp.set_policies([stricter])
    for name in ("web-1", "tok-1"):
        w = env.cp.state.get(name)
        assert w.status is Status.QUARANTINED
        assert w.quarantine.trigger is Trigger.POLICY_CHANGED
        assert "measurement_not_allowed" in w.quarantine.reason
    assert env.plane.sample("attestmesh_policy_reloads_total", result="ok") == 1.0
    assert env.plane.sample("attestmesh_quarantine_events_total", trigger="policy_changed") == 2.0


async def test_policy_change_that_still_admits_changes_nothing(env: Env) -> None:
    assert (await attest(env)).status == 200
    env.cp.set_policies([policy_doc(certificateTTL="2h")])
    assert env.cp.status_of("web-1") is Status.ATTESTED


async def test_check_deadlines_quarantines_an_overdue_workload(env: Env) -> None:
    serial = int((await attest(env)).body["serial"])
    env.clock.advance(minutes=29)
    assert env.cp.check_deadlines() == []
    env.clock.advance(minutes=1)  # the deadline (30 min) itself
    assert env.cp.check_deadlines() == ["web-1"]
    w = env.cp.state.get("web-1")
    assert w.status is Status.QUARANTINED and w.quarantine.trigger is Trigger.DEADLINE_MISSED
    assert env.plane.publisher.last_state.revoked_serials() == {serial}
    assert env.cp.check_deadlines() == []


async def test_check_deadlines_refreshes_the_crl_before_it_goes_stale(env: Env) -> None:
    before = x509.load_pem_x509_crl(env.cp.trust.crl_pem)
    published = len(env.plane.publisher.published)
    env.clock.advance(hours=11)
    env.cp.check_deadlines()
    assert len(env.plane.publisher.published) == published  # still fresh
    env.clock.advance(hours=1, seconds=1)
    env.cp.check_deadlines()
    after = x509.load_pem_x509_crl(env.plane.publisher.last_trust.crl_pem)
    assert after.next_update_utc > before.next_update_utc
    assert after.last_update_utc == env.clock.now - BACKDATE


async def test_restart_keeps_quarantine_revocations_and_the_ca(
    tmp_path: Path, clock: Clock
) -> None:
    async with _env(tmp_path, clock) as env:
        serial = int((await attest(env)).body["serial"])
        await attest(env, path="/v1/renew", measurement=OTHER_MEASUREMENT)
        root = env.plane.ca.root.fingerprint(hashes.SHA256())
    clock.advance(minutes=5)
    async with _env(tmp_path, clock) as env:
        assert env.cp.status_of("web-1") is Status.QUARANTINED
        assert env.plane.ca.root.fingerprint(hashes.SHA256()) == root
        crl = x509.load_pem_x509_crl(env.cp.trust.crl_pem)
        assert crl.get_revoked_certificate_by_serial_number(serial) is not None
        assert env.plane.sample("attestmesh_quarantined_workloads") == 1.0
        again = await attest(env)
        assert (again.status, again.body["error"]) == (403, "quarantined")
        assert [e.kind for e in env.cp.events("web-1")] == [
            EventKind.REGISTERED,
            EventKind.ATTESTED,
            EventKind.QUARANTINED,
        ]


async def test_policy_change_after_restart_quarantines_a_running_workload(
    tmp_path: Path, clock: Clock
) -> None:
    async with _env(tmp_path, clock) as env:
        assert (await attest(env)).status == 200
    async with _env(tmp_path, clock) as env:
        env.cp.set_policies([policy_doc(refs={"sim": {"measurement": [OTHER_MEASUREMENT.hex()]}})])
        assert env.cp.status_of("web-1") is Status.QUARANTINED
