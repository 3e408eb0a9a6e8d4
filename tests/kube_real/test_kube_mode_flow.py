"""``attestmesh controlplane --kubernetes`` end to end against a real kube-apiserver 1.20.2
(moved here from tests/component/test_kube_mode.py, which ran them against tests/fakekube):
pods created through the server become registrations, agents attest with real TokenRequest
tokens bound to their pod, quarantine becomes pod label + condition + Event, invalid policy
resources are refused, a restart re-applies idempotently (the server's audit log shows what
the control plane wrote), and the trust-bundle ConfigMap follows injected pods. The control
plane is the manifests' ServiceAccount: every call it makes is authorized by their RBAC.

Each test has namespaces of its own (the cluster is shared by the session)."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509

from attestmesh.kube_mode import Work, WorkKind
from sidecar.agent import AgentError, SimEvidenceSource, client_ssl_context
from sidecar.inject import AGENT_CONTAINER, BOOTSTRAP_CONTAINER, TRUST_BUNDLE, decode_patch
from tests.kube_real.cluster import free_port
from tests.kube_real.plane import (
    BAD,
    GOOD,
    GROUP_VERSION,
    PLATFORM,
    SHOP,
    WEBHOOK,
    Env,
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
from tests.unit.inject.jsonpatch import apply_patch
from xds.kube import CONDITION_ACCEPTED, CONDITION_ATTESTED, LABEL_QUARANTINED
from xds.state import Status

pytestmark = pytest.mark.integration

TRUST_CM = "attestmesh-trust-bundle"


def own_namespace(admin: Rest, ns: str, labels: dict[str, str] | None = None) -> None:
    admin.apply(namespace_doc(ns, labels))
    for sa in ("web", "other"):
        admin.apply(service_account_doc(ns, sa))


def mesh_policy(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "MeshPolicy",
        "metadata": {"name": "web-callers", "namespace": ns},
        "spec": {
            "destination": {"serviceAccount": "web"},
            "rules": [{"from": [{"serviceAccount": "web"}]}],
        },
    }


def events(admin: Rest, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in admin.items("v1", "Event", ns) if e["reason"] == reason]


def attested_conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in obj["status"].get("conditions", []) if c["type"] == CONDITION_ATTESTED]


def accepted(admin: Rest, ns: str, name: str) -> dict[str, Any]:
    obj = admin.get_or_none(GROUP_VERSION, "AttestationPolicy", ns, name) or {}
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == CONDITION_ACCEPTED), {})


async def test_pod_attests_with_its_service_account_token(env: Env, tmp_path: Path) -> None:
    admin, ns = env.admin, "flow-attest"
    await asyncio.to_thread(own_namespace, admin, ns)
    for doc in (policy("web", ns), mesh_policy(ns)):
        await asyncio.to_thread(admin.apply, doc)
    async with control_plane(env, tmp_path / "state") as plane:
        cp, workload = plane.running.cp, f"{ns}/web-0"
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.3.0.5")
        reg = (
            await until(lambda: cp.state.workloads.get(workload), what="registered")
        ).registration
        assert (reg.namespace, reg.service_account, reg.app_port) == (ns, "web", 8080)
        assert (reg.inbound.address, reg.inbound.port) == ("10.3.0.5", 15006)
        assert reg.pod_uid == stored["metadata"]["uid"]
        await until(lambda: [p.name for p in cp.mesh_policies if p.namespace == ns] or None)
        await until(lambda: [p for p in cp.policies if p.name == f"{ns}/web"] or None)
        assert plane.mode.elector.is_leader

        token = await asyncio.to_thread(pod_token, admin, stored)
        # another service account's real token, one for another audience, a forged one, none
        other = await asyncio.to_thread(
            service_account_token, admin, ns, "other", audiences=["attestmesh"]
        )
        vault = await asyncio.to_thread(pod_token, admin, stored, "vault")
        async with aiohttp.ClientSession() as session:
            cert = await plane.agent(workload, token).attest_once(session)
            assert cert.spiffe_id == f"spiffe://attestmesh.local/ns/{ns}/sa/web"
            leaf = x509.load_pem_x509_certificate(cert.chain_pem)
            san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert san.get_values_for_type(x509.UniformResourceIdentifier) == [cert.spiffe_id]
            assert cp.status_of(workload) is Status.ATTESTED

            for bad in (other, vault, token[:-4] + "AAAA", ""):
                with pytest.raises(AgentError) as exc:
                    await plane.agent(workload, bad).attest_once(session)
                assert (exc.value.status, exc.value.reason) == (401, "identity_invalid")
            assert cp.status_of(workload) is Status.ATTESTED

            # the webhook in the same process, trusted through the caBundle it wrote into the
            # real server's configuration
            hook = await asyncio.to_thread(
                admin.get, "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration",
                None, WEBHOOK,
            )  # fmt: skip
            bundle = base64.b64decode(hook["webhooks"][0]["clientConfig"]["caBundle"])
            assert bundle == cp.ca.bundle_pem
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "u1",
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": SHOP,
                    "operation": "CREATE",
                    "object": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": "web-1",
                            "namespace": SHOP,
                            "annotations": {"attestmesh.dev/tee": "sim"},
                        },
                        "spec": {
                            "serviceAccountName": "web",
                            "containers": [
                                {"name": "app", "image": "web:1", "ports": [{"containerPort": 80}]}
                            ],
                        },
                    },
                },
            }
            assert plane.mode.webhook_url is not None
            async with session.post(
                plane.mode.webhook_url + "/mutate/pods",
                data=json.dumps(review),
                ssl=client_ssl_context(bundle),
            ) as resp:
                assert resp.status == 200
                answer = (await resp.json())["response"]
            # injected: the namespace is labelled attestmesh.dev/inject=enabled (read from the
            # server)
            assert answer["allowed"] is True and decode_patch(answer)
            injected = apply_patch(review["request"]["object"], decode_patch(answer))  # type: ignore[index]
            inits = {c["name"]: c for c in injected["spec"]["initContainers"]}
            boot = inits[BOOTSTRAP_CONTAINER]["command"]
            # the xDS server's SPIFFE ID is checked in the running control plane's domain
            assert boot[boot.index("--trust-domain") + 1] == cp.state.trust_domain
            assert boot[boot.index("--xds-ca") + 1] == TRUST_BUNDLE
            agent_cmd = inits[AGENT_CONTAINER]["command"]
            assert agent_cmd[agent_cmd.index("--sim-measurement") + 1] == GOOD.hex()

            # the bundle those paths mount is in the pod's namespace: the one the API serves
            await plane.mode.drained()
            async with session.get(
                plane.url + "/v1/trust", ssl=client_ssl_context(cp.ca.bundle_pem)
            ) as resp:
                served = (await resp.json())["trust_bundle"]
            cm = await until(lambda: admin.get_or_none("v1", "ConfigMap", ns, TRUST_CM))
            assert cm["data"] == {"root.pem": served}
            assert served.encode() == cp.ca.bundle_pem

            probe = f"http://127.0.0.1:{plane.mode.settings.probe_port}"
            async with session.get(probe + "/readyz") as resp:
                assert resp.status == 200
            async with session.get(probe + "/metrics") as resp:
                assert "attestmesh_kube_actions_total" in await resp.text()
            async with session.get(probe + "/v1/admin/workloads") as resp:
                assert resp.status == 404  # no admin API on the pod network

        # the pod goes away (not bound to a node: deleted at once): so does its registration
        await asyncio.to_thread(admin.delete, "v1", "Pod", ns, "web-0")
        await until(lambda: workload not in cp.state.workloads or None, what="forgotten")


async def test_tampered_reattestation_quarantines_and_restart_reapplies_idempotently(
    env: Env, tmp_path: Path
) -> None:
    admin, ns, node = env.admin, "flow-restart", "flow-n1"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("web", ns))
    node_doc = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}, "spec": {}}
    await asyncio.to_thread(admin.apply, node_doc)
    workload, pod_path = f"{ns}/web-0", f"/api/v1/namespaces/{ns}/pods/web-0"

    def pod() -> dict[str, Any]:
        return dict(admin.get("v1", "Pod", ns, "web-0"))

    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        fixture = injected_fixture_pod("web-0", ns=ns, nodeName=node)
        stored = await running_pod(admin, fixture, "10.3.0.6")
        await until(lambda: cp.state.workloads.get(workload), what="registered")
        await until(lambda: [p for p in cp.policies if p.name == f"{ns}/web"] or None)
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            source = SimEvidenceSource(PLATFORM, GOOD)
            agent = plane.agent(workload, token, source=source)
            await agent.attest_once(session)
            source.measurement = BAD  # a tampered image
            with pytest.raises(AgentError) as exc:
                await agent.attest_once(session)
            assert exc.value.status == 403
        assert cp.status_of(workload) is Status.QUARANTINED
        await plane.mode.drained()
        obj = await asyncio.to_thread(pod)
        assert obj["metadata"]["labels"][LABEL_QUARANTINED] == "true"
        (cond,) = attested_conditions(obj)
        assert cond["status"] == "False" and cond["reason"] == "AppraisalFailed"
        (event,) = await asyncio.to_thread(events, admin, ns, "Quarantined")
        assert "measurement" in event["message"] and event["count"] == 1
        # onFailure quarantine: no eviction; the platform is fine: its node is not tainted
        stored_node = await asyncio.to_thread(admin.get, "v1", "Node", None, node)
        # (the server's own not-ready taint aside: no kubelet reports this node)
        assert ours(stored_node) == []
    pod_writes = await asyncio.to_thread(writes_to, env, pod_path)
    assert pod_writes  # the label and the condition

    # restart with the same state: the quarantine is re-derived and re-applied, changing nothing
    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        assert cp.status_of(workload) is Status.QUARANTINED
        await until(lambda: any(w.kind is WorkKind.REAPPLY for w in plane.mode.completed) or None)
        await plane.mode.drained()
        obj = await asyncio.to_thread(pod)
        assert obj["metadata"]["labels"][LABEL_QUARANTINED] == "true"
        assert len(attested_conditions(obj)) == 1
        (event,) = await asyncio.to_thread(events, admin, ns, "Quarantined")
        assert event["count"] == 1  # re-applying what is in place is no new occurrence
        assert await asyncio.to_thread(writes_to, env, pod_path) == pod_writes  # nothing new
        async with aiohttp.ClientSession() as session:
            with pytest.raises(AgentError) as exc:  # still quarantined: no certificate
                await plane.agent(workload, token).attest_once(session)
            assert exc.value.reason == "quarantined"

            # the operator releases it: label gone, condition True; a fresh attestation admits
            assert cp.release(workload)
            await plane.mode.drained()
            obj = await asyncio.to_thread(pod)
            assert LABEL_QUARANTINED not in obj["metadata"]["labels"]
            (cond,) = attested_conditions(obj)
            assert cond["status"] == "True"
            await plane.agent(workload, token).attest_once(session)
            assert cp.status_of(workload) is Status.ATTESTED
    lease = await asyncio.to_thread(
        admin.get, "coordination.k8s.io/v1", "Lease", "attestmesh-system",
        "attestmesh-controlplane-leader",
    )  # fmt: skip
    assert lease["spec"].get("holderIdentity") in (None, "")  # handed over on the way out
    await asyncio.to_thread(admin.delete, "v1", "Node", None, node)


async def test_invalid_policy_resource_is_refused_and_the_previous_stays(
    env: Env, tmp_path: Path
) -> None:
    """1.20 stores what only the CRDs' CEL rules forbid (it drops them): the control plane's
    parser is the check that refuses it, as it is on any server without them."""
    admin, ns = env.admin, "flow-invalid"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("web", ns))
    async with control_plane(env, tmp_path / "state") as plane:
        cp, workload = plane.running.cp, f"{ns}/web-0"
        await until(lambda: accepted(admin, ns, "web").get("status") == "True" or None)
        broken = policy(
            "web", ns, allowedTees=["sim", "tdx"], certificateTTL="1h", reattestationInterval="2h"
        )
        await asyncio.to_thread(admin.apply, broken)  # stored: 1.20 has no CEL
        await until(lambda: accepted(admin, ns, "web").get("status") == "False" or None)
        cond = accepted(admin, ns, "web")
        assert cond["reason"] == "Invalid"
        assert "required because tdx is allowed" in cond["message"]
        assert "must not exceed certificateTTL" in cond["message"]
        assert "previous valid version stays in force" in cond["message"]
        # the Event is written after the condition: wait for it, then it is the only one
        await until(lambda: events(admin, ns, "Invalid") or None, what="Invalid Event")
        (event,) = await asyncio.to_thread(events, admin, ns, "Invalid")
        assert event["involvedObject"]["kind"] == "AttestationPolicy"
        (mine,) = [p for p in plane.mode.policies if p.name == f"{ns}/web"]
        assert sorted(mine.allowed_tees) == ["sim"]  # the old, valid spec
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.3.0.7")
        await until(lambda: cp.state.workloads.get(workload), what="registered")
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            cert = await plane.agent(workload, token).attest_once(session)  # the old policy
        assert cert.spiffe_id.endswith(f"/ns/{ns}/sa/web")


def trust_cm(admin: Rest, ns: str) -> dict[str, Any] | None:
    found = admin.get_or_none("v1", "ConfigMap", ns, TRUST_CM)
    return None if found is None else dict(found)


async def test_trust_bundle_configmap_follows_injected_pods_and_is_repaired(
    env: Env, tmp_path: Path
) -> None:
    admin = env.admin
    shop, pay, quiet = "tb-shop", "tb-pay", "tb-quiet"
    await asyncio.to_thread(own_namespace, admin, shop, {"attestmesh.dev/inject": "enabled"})
    for ns in (pay, quiet):  # not labelled
        await asyncio.to_thread(own_namespace, admin, ns)
    # someone's stale or forged bundle under our name: replaced, their other keys kept
    forged = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TRUST_CM, "namespace": shop},
        "data": {"root.pem": "forged", "note": "kept"},
    }
    await asyncio.to_thread(admin.apply, forged)
    mine = "/api/v1/namespaces/tb-"
    async with (
        control_plane(env, tmp_path / "a", "cp-a") as plane,
        # its own webhook port (the configuration points at the leader's)
        control_plane(
            replace(env, webhook_port=free_port()), tmp_path / "b", "cp-b", lead=False
        ) as follower,
    ):
        bundle = plane.running.cp.ca.bundle_pem.decode()
        await plane.mode.drained()
        # a labelled namespace, before any pod needs it

        def replaced() -> dict[str, Any] | None:
            c = trust_cm(admin, shop)
            return c if c is not None and c["data"].get("root.pem") == bundle else None

        cm = await until(replaced, what="shop's ConfigMap replaced")
        assert cm["data"] == {"root.pem": bundle, "note": "kept"}
        assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "attestmesh"
        assert trust_cm(admin, pay) is None and trust_cm(admin, quiet) is None

        # a pod opted in (injected) in an unlabelled namespace, not yet started (no IP: it
        # waits for this very volume): the ConfigMap appears without a registration
        pending = injected_fixture_pod("api-0", ns=pay)
        await asyncio.to_thread(admin.create, pending)
        cm = await until(lambda: trust_cm(admin, pay), what="pay's ConfigMap")
        assert cm["data"] == {"root.pem": bundle}
        assert f"{pay}/api-0" not in plane.running.cp.state.workloads

        # idempotent: pod churn and re-applies write nothing more
        writes = await asyncio.to_thread(writes_to, env, mine)
        assert writes == [
            ("update", f"/api/v1/namespaces/{shop}/configmaps/{TRUST_CM}"),
            ("create", f"/api/v1/namespaces/{pay}/configmaps"),
        ]
        await asyncio.to_thread(
            admin.patch, "v1", "Pod", pay, "api-0", {"metadata": {"labels": {"v": "2"}}}
        )
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        assert await asyncio.to_thread(writes_to, env, mine) == writes

        # drift is repaired on the next re-apply: an edit, a deletion
        await asyncio.to_thread(
            admin.patch, "v1", "ConfigMap", shop, TRUST_CM, {"data": {"root.pem": "edited"}}
        )
        await asyncio.to_thread(admin.delete, "v1", "ConfigMap", pay, TRUST_CM)
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        for ns in (shop, pay):
            repaired = await asyncio.to_thread(trust_cm, admin, ns)
            assert repaired is not None and repaired["data"]["root.pem"] == bundle
        # a namespace labelled later gets its own
        await asyncio.to_thread(
            admin.patch, "v1", "Namespace", None, quiet,
            {"metadata": {"labels": {"attestmesh.dev/inject": "enabled"}}},
        )  # fmt: skip
        cm = await until(lambda: trust_cm(admin, quiet), what="quiet's ConfigMap")
        assert cm["data"] == {"root.pem": bundle}
        # only the leader writes
        await follower.mode.drained()
        assert not [w for w in follower.mode.completed if w.kind is WorkKind.TRUST_BUNDLE]
    # every ConfigMap request the control plane made was allowed by the manifests' RBAC
    # (which grants get/update on this one name and create); it touched no other name
    requests = [
        e for e in await asyncio.to_thread(audited, env) if "/configmaps" in e["requestURI"]
    ]
    assert requests
    for e in requests:
        path = e["requestURI"].split("?")[0]
        assert path.endswith("/configmaps") or path.endswith(f"/configmaps/{TRUST_CM}"), path
        assert e["responseStatus"]["code"] != 403, e
