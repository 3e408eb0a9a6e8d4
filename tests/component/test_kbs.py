"""The KBS resource protocol (CoCo encrypted images) against a real OpenBao, with a client
written here from the published protocol description (confidential-containers KBS,
docs/kbs_attestation_protocol.md): POST /kbs/v0/auth (Request -> Challenge + kbs-session-id
cookie), POST /kbs/v0/attest (Attestation: tee-pubkey JWK + tee-evidence), GET
/kbs/v0/resource/<repository>/<type>/<tag> (a JWE, flattened JSON, to tee-pubkey; 401 not
authenticated, 403 not allowed, 404 unknown). The JWE is decrypted here by the test's own reading
of RFC 7516/7518 (tests/unit/test_sealing.py); the evidence binding is computed here from this
project's documented rule (SHA-512 of the canonical runtime data {nonce, tee-pubkey})."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane.kbs import KbsService, build_kbs_app
from attestmesh.controlplane.secrets import SecretPolicies
from certs.ca import issue_serving_credentials
from certs.evidence import sim
from certs.openbao import OpenBaoClient, TokenFile
from tests.bao_harness import Bao, start_bao
from tests.unit.fixtures_core import (
    MEASUREMENT,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    Plane,
    make_control_plane,
    policy_doc,
    registration,
)
from tests.unit.test_sealing import _decrypt_jwe, _jwk_ec
from xds.state import EventKind, Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
IMAGE_KEY = "image-key-7f3a91"  # the KV entry's value, served as the resource


def secret_policy(service_account: str = "web") -> dict[str, Any]:
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "SecretPolicy",
        "metadata": {"name": "images", "namespace": "default"},
        "spec": {
            "secrets": [
                {
                    "name": "image-key",
                    "kv": {"mount": "secret", "path": "images/web"},
                    "kbsResource": "default/key/web",
                }
            ],
            "rules": [
                {
                    "from": [{"serviceAccount": service_account}],
                    "secrets": ["image-key"],
                    "whenClaims": {"tees": ["sim"]},
                }
            ],
        },
    }


class KbsClient:
    """The Key Broker Client side, from the protocol description only."""

    def __init__(
        self, url: str, ca: bytes, platform: ec.EllipticCurvePrivateKey = PLATFORM
    ) -> None:
        self.url = url
        self.platform = platform
        self.ssl = ssl.create_default_context(cadata=ca.decode())
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
        self.tee_key = ec.generate_private_key(ec.SECP256R1())
        self.jwk = _jwk_ec(self.tee_key)

    async def close(self) -> None:
        await self.session.close()

    async def auth(self, tee: str = "sample") -> tuple[int, Any]:
        body = {"version": "0.1.0", "tee": tee, "extra-params": ""}
        async with self.session.post(f"{self.url}/kbs/v0/auth", json=body, ssl=self.ssl) as r:
            return r.status, await r.json(content_type=None)

    def evidence(self, nonce: str, measurement: bytes = MEASUREMENT) -> bytes:
        runtime = json.dumps(
            {"nonce": nonce, "tee-pubkey": self.jwk}, sort_keys=True, separators=(",", ":")
        ).encode()
        return sim.build_report(
            self.platform, report_data=hashlib.sha512(runtime).digest(), measurement=measurement
        )

    async def attest(self, workload: str, evidence: bytes, jwk: Any = None) -> tuple[int, Any]:
        body = {
            "tee-pubkey": jwk if jwk is not None else self.jwk,
            "tee-evidence": {"workload": workload, "evidence": base64.b64encode(evidence).decode()},
        }
        async with self.session.post(f"{self.url}/kbs/v0/attest", json=body, ssl=self.ssl) as r:
            text = await r.text()
            return r.status, json.loads(text) if text else None

    async def resource(self, path: str) -> tuple[int, Any]:
        async with self.session.get(f"{self.url}/kbs/v0/resource/{path}", ssl=self.ssl) as r:
            return r.status, await r.json(content_type=None)

    async def attested(self, workload: str, measurement: bytes = MEASUREMENT) -> int:
        status, challenge = await self.auth()
        assert status == 200, challenge
        assert set(challenge) == {"nonce", "extra-params"}
        status, _ = await self.attest(workload, self.evidence(challenge["nonce"], measurement))
        return status


@dataclass
class Kbs:
    plane: Plane
    bao: Bao
    policies: SecretPolicies
    url: str
    bundle: bytes
    service: KbsService

    def client(self) -> KbsClient:
        return KbsClient(self.url, self.bundle)

    def sample(self, result: str, reason: str, operation: str = "kbs") -> float:
        return self.plane.sample(
            "attestmesh_secret_requests_total", operation=operation, result=result, reason=reason
        )


@pytest.fixture
async def kbs(tmp_path: Path) -> AsyncIterator[Kbs]:
    bao = await start_bao(tmp_path / "bao")
    try:
        await bao.kv_put("images/web", {"value": IMAGE_KEY})
        (tmp_path / "tok").write_text(bao.root_token)
        plane = make_control_plane(
            tmp_path / "cp",
            clock=Clock(datetime.now(UTC)),
            platform_key=PLATFORM,
            policies=[policy_doc(service_accounts=["web", "api"])],
            registrations=[
                registration("web-1"),
                registration("api-1", service_account="api", service="api"),
            ],
        )
        policies = SecretPolicies()
        policies.set_docs([secret_policy()])
        import secrets as _secrets

        async with aiohttp.ClientSession() as session:
            service = KbsService(
                state=lambda: plane.cp.state,
                verifiers=lambda: plane.cp.verifiers,
                attestation_policies=lambda: plane.cp.policies,
                secret_policies=policies,
                backend=OpenBaoClient(bao.url, TokenFile(tmp_path / "tok"), session),
                audit=plane.cp.record_events,
                on_decision=lambda op, result, reason: plane.metrics.secret_requests.labels(
                    op, result, reason
                ).inc(),
                clock=lambda: datetime.now(UTC),
                random_bytes=_secrets.token_bytes,
            )
            cert, key = issue_serving_credentials(
                plane.ca,
                tmp_path,
                "kbs",
                spiffe_id=f"spiffe://{TRUST_DOMAIN}/ns/attestmesh-system/sa/controlplane",
                dns_names=["localhost"],
                ips=["127.0.0.1"],
                now=datetime.now(UTC),
                ttl=timedelta(hours=1),
            )
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(cert, key)
            runner = web.AppRunner(build_kbs_app(service), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
            await site.start()
            try:
                url = f"https://127.0.0.1:{runner.addresses[0][1]}"
                yield Kbs(plane, bao, policies, url, plane.ca.bundle_pem, service)
            finally:
                await runner.cleanup()
                await plane.cp.flushed()
                plane.store.close()
    finally:
        bao.stop()


async def test_attested_pod_gets_the_image_key_encrypted_to_its_tee_key(kbs: Kbs) -> None:
    c = kbs.client()
    try:
        assert await c.attested("web-1") == 200
        status, jwe = await c.resource("default/key/web")
    finally:
        await c.close()
    assert status == 200
    assert set(jwe) == {"protected", "encrypted_key", "iv", "ciphertext", "tag"}
    assert IMAGE_KEY not in json.dumps(jwe)
    assert _decrypt_jwe(jwe, c.tee_key) == IMAGE_KEY.encode()
    (event,) = [e for e in kbs.plane.cp.events("web-1") if e.kind is EventKind.SECRET_RELEASED]
    assert event.code == "kbs" and IMAGE_KEY not in event.reason
    assert kbs.sample("released", "ok") == 1


async def test_unattested_requests_get_401(kbs: Kbs) -> None:
    c = kbs.client()
    try:
        no_session, _ = await c.resource("default/key/web")
        status, _ = await c.auth()
        assert status == 200
        challenged_only, problem = await c.resource("default/key/web")
    finally:
        await c.close()
    assert (no_session, challenged_only) == (401, 401)
    assert problem["type"].endswith("/not_attested")
    assert kbs.sample("released", "ok") == 0


async def test_quarantine_stops_release_at_once_and_attestation(kbs: Kbs) -> None:
    c = kbs.client()
    try:
        assert await c.attested("web-1") == 200
        kbs.plane.cp.quarantine("web-1", Trigger.OPERATOR, "test")
        status, problem = await c.resource("default/key/web")
        again = await c.attested("web-1")
    finally:
        await c.close()
    assert status == 403 and problem["type"].endswith("/quarantined")
    assert again == 403
    refused = [e for e in kbs.plane.cp.events("web-1") if e.kind is EventKind.SECRET_REFUSED]
    assert [e.code for e in refused] == ["quarantined"]


@pytest.mark.parametrize("case", ["other_nonce", "other_key", "measurement", "unknown_workload"])
async def test_evidence_that_does_not_bind_or_is_not_admitted_is_refused(
    kbs: Kbs, case: str
) -> None:
    c = kbs.client()
    try:
        _, challenge = await c.auth()
        nonce, workload, measurement = challenge["nonce"], "web-1", MEASUREMENT
        jwk = None
        if case == "other_nonce":
            nonce = base64.b64encode(bytes(32)).decode()
        elif case == "measurement":
            measurement = OTHER_MEASUREMENT
        elif case == "unknown_workload":
            workload = "nobody"
        evidence = c.evidence(nonce, measurement)
        if case == "other_key":  # bound to our key, but another key is sent
            jwk = _jwk_ec(ec.generate_private_key(ec.SECP256R1()))
        status, problem = await c.attest(workload, evidence, jwk)
        after, _ = await c.resource("default/key/web")
    finally:
        await c.close()
    assert status == 401, problem
    assert after == 401  # the session is gone with its failed attestation
    assert kbs.sample("released", "ok") == 0


async def test_policy_decides_which_pod_gets_which_resource(kbs: Kbs) -> None:
    api, web_ = kbs.client(), kbs.client()
    try:
        assert await api.attested("api-1") == 200
        refused, _ = await api.resource("default/key/web")
        assert await web_.attested("web-1") == 200
        unknown, _ = await web_.resource("default/key/other")
        kbs.policies.set_docs([secret_policy(service_account="api")])
        changed, _ = await web_.resource("default/key/web")
        allowed, jwe = await api.resource("default/key/web")
    finally:
        await api.close()
        await web_.close()
    assert (refused, unknown, changed, allowed) == (403, 404, 403, 200)
    assert _decrypt_jwe(jwe, api.tee_key) == IMAGE_KEY.encode()


async def test_protocol_misuse_is_refused(kbs: Kbs) -> None:
    c = kbs.client()
    try:
        async with c.session.post(
            f"{c.url}/kbs/v0/auth", json={"version": "9.9", "tee": "sample"}, ssl=c.ssl
        ) as r:
            bad_version = r.status
        bad_tee, _ = await c.auth("amd-sev")
        not_configured, _ = await c.auth("intel-tdx")  # no TDX verifier in this control plane
        _, challenge = await c.auth()
        rsa15 = {"kty": "RSA", "alg": "RSA1_5", "n": "AQAB", "e": "AQAB"}
        weak, _ = await c.attest("web-1", c.evidence(challenge["nonce"]), rsa15)
        assert await c.attested("web-1") == 200
        replay, _ = await c.attest("web-1", c.evidence(challenge["nonce"]))
    finally:
        await c.close()
    assert (bad_version, bad_tee, not_configured, weak, replay) == (400, 400, 400, 400, 401)


async def test_an_attested_session_looping_on_reads_is_limited(kbs: Kbs) -> None:
    from attestmesh.controlplane import AttestationLimiter

    kbs.service._limiter = AttestationLimiter(burst=2, refill=timedelta(hours=1))
    c = kbs.client()
    try:
        assert await c.attested("web-1") == 200
        statuses = [(await c.resource("default/key/web"))[0] for _ in range(4)]
    finally:
        await c.close()
    assert statuses == [200, 200, 429, 429]
    assert kbs.sample("refused", "too_many_requests") == 2
    assert [e.kind for e in kbs.plane.cp.events("web-1") if e.code == "kbs"] == [
        EventKind.SECRET_RELEASED
    ] * 2


async def test_auth_spam_neither_evicts_sessions_nor_grows_state(kbs: Kbs) -> None:
    """10,000 unauthenticated /auth calls while one pod is attested and another is between its
    challenge and its attestation: both go on, and the KBS holds nothing for the spam."""
    attested, in_flight, spam = kbs.client(), kbs.client(), kbs.client()
    try:
        assert await attested.attested("web-1") == 200
        _, challenge = await in_flight.auth()
        held = len(kbs.service.sessions)
        body = {"version": "0.1.0", "tee": "sample", "extra-params": ""}

        async def one() -> int:
            async with spam.session.post(f"{spam.url}/kbs/v0/auth", json=body, ssl=spam.ssl) as r:
                await r.read()
                return r.status

        statuses: list[int] = []
        for _ in range(100):
            statuses += await asyncio.gather(*(one() for _ in range(100)))
        assert statuses == [200] * 10_000
        assert len(kbs.service.sessions) == held == 1
        late, _ = await in_flight.attest("web-1", in_flight.evidence(challenge["nonce"]))
        still, jwe = await attested.resource("default/key/web")
        fresh, _ = await in_flight.resource("default/key/web")
        unbound, _ = await spam.attest("web-1", spam.evidence(base64.b64encode(bytes(32)).decode()))
    finally:
        for c in (attested, in_flight, spam):
            await c.close()
    assert (late, still, fresh, unbound) == (200, 200, 200, 401)
    assert _decrypt_jwe(jwe, attested.tee_key) == IMAGE_KEY.encode()
    assert len(kbs.service.sessions) == 2  # the two attested sessions; nothing for the spam
