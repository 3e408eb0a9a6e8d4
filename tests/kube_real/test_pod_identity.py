"""Identity is per pod (issue 8 item 3), against a real kube-apiserver 1.20.2 (moved here from
tests/component/test_pod_identity.py, which ran it against tests/fakekube): a request is bound
to the pod by its projected service-account token (a real TokenRequest bound to the Pod, read
back by a real TokenReview: ``user.extra`` pod-name / pod-uid), not to the service account
every replica shares.

A sibling pod of the same service account, holding its own valid token, tries to attest, fail
and renew in web-0's name; a quarantined pod tries to obtain a certificate by naming its
sibling; a pod replaced under the same name is a new workload, and the old pod's token is
refused by the control plane while the server's 10 s success cache still vouches for it, and
by the server itself after. What the control plane wrote is read from the server's audit log.
Each test has a namespace of its own (the cluster is shared by the session)."""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from sidecar.agent import SimEvidenceSource, build_csr, client_ssl_context
from tests.kube_real.plane import (
    BAD,
    GOOD,
    PLATFORM,
    Env,
    Plane,
    audited,
    control_plane,
    injected_fixture_pod,
    namespace_doc,
    ours,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
    service_account_token,
    writes_to,
)
from tests.kube_real.rest import Rest, until
from xds.kube import LABEL_QUARANTINED
from xds.state import Status, WorkloadState

pytestmark = pytest.mark.integration

FOREIGN_PLATFORM = ec.generate_private_key(ec.SECP256R1())  # a platform the policy never trusts
# Every identity refusal answers alike (no oracle for enumerating workloads); the identity
# check's own reason is logged by the control plane.
REFUSED = {"error": "identity_invalid", "detail": "unknown workload or bad credentials"}


@dataclass
class Siblings:
    ns: str
    web0: dict[str, Any]  # the stored pods
    web1: dict[str, Any]
    web_token: str  # web-0's projected token (bound to it)
    sibling_token: str  # web-1's own: valid, same service account
    legacy_token: str  # a valid token of the service account bound to no pod

    @property
    def workload(self) -> str:
        return f"{self.ns}/web-0"

    @property
    def sibling(self) -> str:
        return f"{self.ns}/web-1"


async def seed_siblings(admin: Rest, ns: str) -> Siblings:
    """web-0 on node <ns>-n1, web-1 on node <ns>-n2: one StatefulSet, one service account."""
    docs = [namespace_doc(ns), service_account_doc(ns, "web"), policy("web", ns)]
    docs += [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"{ns}-{n}"}, "spec": {}}
             for n in ("n1", "n2")]  # fmt: skip
    for doc in docs:
        await asyncio.to_thread(admin.apply, doc)
    web0 = await running_pod(
        admin, injected_fixture_pod("web-0", ns=ns, nodeName=f"{ns}-n1"), "10.5.0.5"
    )
    web1 = await running_pod(
        admin, injected_fixture_pod("web-1", ns=ns, nodeName=f"{ns}-n2"), "10.5.0.6"
    )
    return Siblings(
        ns,
        web0,
        web1,
        await asyncio.to_thread(pod_token, admin, web0),
        await asyncio.to_thread(pod_token, admin, web1),
        await asyncio.to_thread(service_account_token, admin, ns, "web", audiences=["attestmesh"]),
    )


async def ready(plane: Plane, s: Siblings) -> None:
    cp = plane.running.cp
    await until(
        lambda: (s.workload in cp.state.workloads and s.sibling in cp.state.workloads) or None,
        what="both registered",
    )
    await until(lambda: [p for p in cp.policies if p.name == f"{s.ns}/web"] or None)


async def attempt(
    plane: Plane,
    session: aiohttp.ClientSession,
    path: str,
    workload: str,
    token: str,
    platform: ec.EllipticCurvePrivateKey = PLATFORM,
    measurement: bytes = GOOD,
) -> tuple[int, dict[str, Any]]:
    """One request on the real HTTPS API as an agent would send it: challenge, evidence bound
    to the nonce and key, then ``path`` (/v1/attest or /v1/renew) with ``token``."""
    ssl = client_ssl_context(plane.running.bundle_pem)
    async with session.post(plane.url + "/v1/challenge", json={}, ssl=ssl) as resp:
        nonce = base64.b64decode((await resp.json())["nonce"])
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    evidence = SimEvidenceSource(platform, measurement).collect(
        expected_report_data(nonce, spki), nonce=nonce, spki=spki
    )
    body = {
        "workload": workload,
        "tee": evidence.tee,
        "evidence": base64.b64encode(evidence.evidence).decode(),
        "csr": build_csr(key).decode(),
        "nonce": base64.b64encode(nonce).decode(),
    }
    headers = {"Authorization": f"Bearer {token}"}
    async with session.post(plane.url + path, json=body, ssl=ssl, headers=headers) as resp:
        return resp.status, await resp.json()


def rejected_attestations(plane: Plane) -> float:
    (metric,) = plane.running.metrics.attestations.collect()
    return sum(
        s.value
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("result") == "rejected"
    )


def sample(plane: Plane, name: str, **labels: str) -> float:
    value = plane.running.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def refusal_logged(caplog: pytest.LogCaptureFixture, workload: str) -> str:
    """The detail of the last identity refusal the control plane logged."""
    prefix = f"identity refused for {workload}: "
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]
    assert lines, "no identity refusal was logged"
    return lines[-1][len(prefix) :]


def pod_and_node_writes(env: Env, s: Siblings) -> list[tuple[str, str]]:
    return writes_to(env, f"/api/v1/namespaces/{s.ns}/pods/web-0") + writes_to(
        env, f"/api/v1/nodes/{s.ns}-n1"
    )


def token_reviews(env: Env) -> int:
    return sum(
        1
        for e in audited(env)
        if e["verb"] == "create" and e["requestURI"].startswith("/apis/authentication.k8s.io/")
    )


async def test_a_sibling_pod_cannot_attest_fail_or_renew_in_web0s_name(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    admin = env.admin
    s = await seed_siblings(admin, "pid-sibling")
    async with (
        control_plane(env, tmp_path / "state") as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp
        await ready(plane, s)
        assert cp.state.get(s.workload).registration.pod_uid == s.web0["metadata"]["uid"]
        status, body = await attempt(plane, session, "/v1/attest", s.workload, s.web_token)
        assert status == 200, body
        await plane.mode.drained()
        serials = [c.serial for c in cp.state.get(s.workload).certificates]
        issued = sample(plane, "attestmesh_certificates_issued_total")
        before = await asyncio.to_thread(pod_and_node_writes, env, s)
        events_before = await asyncio.to_thread(admin.items, "v1", "Event", s.ns)
        reviews_before = await asyncio.to_thread(token_reviews, env)

        # web-1 holds a valid token of the same service account. In web-0's name it tries a good
        # attestation, a renewal, a tampered measurement (would quarantine web-0) and evidence
        # from a platform nobody trusts (would quarantine web-0 and taint its node, n1).
        tries = [
            ("/v1/attest", PLATFORM, GOOD),
            ("/v1/renew", PLATFORM, GOOD),
            ("/v1/attest", PLATFORM, BAD),
            ("/v1/renew", PLATFORM, BAD),
            ("/v1/attest", FOREIGN_PLATFORM, GOOD),
            ("/v1/renew", FOREIGN_PLATFORM, GOOD),
        ]
        for path, platform, measurement in tries:
            status, body = await attempt(
                plane, session, path, s.workload, s.sibling_token, platform, measurement
            )
            assert (status, body) == (401, REFUSED), (path, body)
            assert refusal_logged(caplog, s.workload).startswith(
                f"token_pod_mismatch: token bound to pod {s.sibling} presented for {s.workload}"
            )
        # the service account's legacy (pod-less) token is no better
        for path in ("/v1/attest", "/v1/renew"):
            status, body = await attempt(
                plane, session, path, s.workload, s.legacy_token, measurement=BAD
            )
            assert (status, body) == (401, REFUSED), body
            detail = refusal_logged(caplog, s.workload)
            assert detail.startswith("token_not_pod_bound: ")
            assert "authentication.kubernetes.io/pod-name" in detail

        await plane.mode.drained()
        # nothing changed: web-0 attested with the same certificates, no new certificate, no
        # quarantine label, condition, Event, eviction or node taint; only refusals counted
        w = cp.state.get(s.workload)
        assert w.status is Status.ATTESTED and [c.serial for c in w.certificates] == serials
        assert cp.state.revocations == ()
        assert sample(plane, "attestmesh_certificates_issued_total") == issued
        assert await asyncio.to_thread(pod_and_node_writes, env, s) == before
        assert await asyncio.to_thread(admin.items, "v1", "Event", s.ns) == events_before
        web0 = await asyncio.to_thread(admin.get, "v1", "Pod", s.ns, "web-0")
        assert LABEL_QUARANTINED not in web0["metadata"]["labels"]
        n1 = await asyncio.to_thread(admin.get, "v1", "Node", None, f"{s.ns}-n1")
        assert ours(n1) == []
        refused = sample(
            plane, "attestmesh_api_rejections_total", endpoint="attest", reason="identity_invalid"
        ) + sample(
            plane, "attestmesh_api_rejections_total", endpoint="renew", reason="identity_invalid"
        )
        assert refused == len(tries) + 2
        assert rejected_attestations(plane) == 0  # no evidence was even looked at
        # every refusal came from a TokenReview the server answered
        assert await asyncio.to_thread(token_reviews, env) >= reviews_before + len(tries) + 2

        # web-0 itself still renews with its own token; and its own tampered evidence is what
        # quarantines it (the refused payload was a real threat)
        status, body = await attempt(plane, session, "/v1/renew", s.workload, s.web_token)
        assert status == 200, body
        status, body = await attempt(
            plane, session, "/v1/renew", s.workload, s.web_token, measurement=BAD
        )
        assert status == 403, body
        assert cp.status_of(s.workload) is Status.QUARANTINED
        assert cp.status_of(s.sibling) is Status.PENDING  # the sibling gained nothing either


async def test_a_quarantined_pod_cannot_get_a_certificate_by_naming_its_sibling(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    admin = env.admin
    s = await seed_siblings(admin, "pid-quarantined")
    async with (
        control_plane(env, tmp_path / "state") as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp
        await ready(plane, s)
        for name, token in ((s.workload, s.web_token), (s.sibling, s.sibling_token)):
            status, body = await attempt(plane, session, "/v1/attest", name, token)
            assert status == 200, body
        # web-1 runs a tampered image: its own evidence quarantines it
        status, body = await attempt(
            plane, session, "/v1/renew", s.sibling, s.sibling_token, measurement=BAD
        )
        assert status == 403, body
        assert cp.status_of(s.sibling) is Status.QUARANTINED
        await plane.mode.drained()
        web1 = await asyncio.to_thread(admin.get, "v1", "Pod", s.ns, "web-1")
        assert web1["metadata"]["labels"][LABEL_QUARANTINED] == "true"
        issued = sample(plane, "attestmesh_certificates_issued_total")
        web0 = cp.state.get(s.workload)

        # it asks for a certificate in its healthy sibling's name, with good evidence
        for path in ("/v1/attest", "/v1/renew"):
            status, body = await attempt(plane, session, path, s.workload, s.sibling_token)
            assert (status, body) == (401, REFUSED), body
            assert refusal_logged(caplog, s.workload).startswith(
                f"token_pod_mismatch: token bound to pod {s.sibling}"
            )
        # and in its own name it is quarantined
        status, body = await attempt(plane, session, "/v1/attest", s.sibling, s.sibling_token)
        assert (status, body["error"]) == (403, "quarantined"), body
        assert sample(plane, "attestmesh_certificates_issued_total") == issued
        assert cp.state.get(s.workload) == web0  # web-0 untouched: no certificate added for it
        assert cp.status_of(s.sibling) is Status.QUARANTINED


def token_review(admin: Rest, token: str) -> dict[str, Any]:
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token, "audiences": ["attestmesh"]},
    }
    return dict(admin.call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body)["status"])


def force_delete(admin: Rest, ns: str, name: str) -> None:
    """As the kubelet's final delete does (the pod is bound to a node nobody runs)."""
    admin.call(
        "DELETE",
        admin.path("v1", "Pod", ns, name),
        {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
    )


async def test_a_recreated_pod_is_a_new_workload_and_the_old_pods_token_is_refused(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    admin = env.admin
    s = await seed_siblings(admin, "pid-recreated")
    # a second token of the old pod, never reviewed before it is gone (so never cached)
    unused = await asyncio.to_thread(pod_token, admin, s.web0)
    async with (
        control_plane(env, tmp_path / "state") as plane,
        aiohttp.ClientSession() as session,
    ):
        await ready(plane, s)
        status, body = await attempt(plane, session, "/v1/attest", s.workload, s.web_token)
        assert status == 200, body
    old_uid = s.web0["metadata"]["uid"]

    # while the control plane is down, the StatefulSet replaces web-0 (same name, new uid).
    # The server caches a successful token review for 10 s: review web-0's token now, so it is
    # still vouched for when the control plane, back, asks about it
    assert (await asyncio.to_thread(token_review, admin, s.web_token))["authenticated"] is True
    cached_at = time.monotonic()
    await asyncio.to_thread(force_delete, admin, s.ns, "web-0")
    new = await running_pod(
        admin, injected_fixture_pod("web-0", ns=s.ns, nodeName=f"{s.ns}-n1"), "10.5.0.7"
    )
    new_uid = new["metadata"]["uid"]
    assert new_uid != old_uid
    async with (
        control_plane(env, tmp_path / "state") as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp

        def reregistered() -> WorkloadState | None:
            w = cp.state.workloads.get(s.workload)
            return w if w is not None and w.registration.pod_uid == new_uid else None

        w = await until(reregistered, what="the new pod registered")
        # the previous pod's standing is not the new pod's: registered afresh, not attested
        assert (w.status, w.attestation, w.certificates) == (Status.PENDING, None, ())
        # the previous pod's token, while the server's success cache still vouches for it:
        # the uid it is bound to is not the registered pod's
        status, body = await attempt(plane, session, "/v1/attest", s.workload, s.web_token)
        elapsed = time.monotonic() - cached_at
        assert elapsed < 9, f"{elapsed:.1f} s since the review: the server's cache (10 s) ran out"
        assert (status, body) == (401, REFUSED), body
        assert refusal_logged(caplog, s.workload) == (
            f"token_pod_uid_mismatch: token bound to pod uid {old_uid} presented for "
            f"{s.workload}, a different pod of that name"
        )
        # a token the cache does not hold: the API server refuses it itself, once its pod
        # informer has seen the new pod (the server checks the claim against its cache of
        # pods, which follows the replacement a moment later)
        await until(
            lambda: not token_review(admin, unused).get("authenticated") or None,
            what="the server's pod cache caught up",
        )
        status, body = await attempt(plane, session, "/v1/attest", s.workload, unused)
        assert (status, body) == (401, REFUSED), body
        assert refusal_logged(caplog, s.workload) == (
            f"token_invalid: [invalid bearer token, Pod UID ({new_uid}) does not "
            f"match claim ({old_uid})]"
        )
        # the new pod's own token
        token = await asyncio.to_thread(pod_token, admin, new)
        status, body = await attempt(plane, session, "/v1/attest", s.workload, token)
        assert status == 200, body
        assert cp.status_of(s.workload) is Status.ATTESTED
