"""``attestmesh controlplane --kubernetes`` in process against tests/fakekube, for what the real
API servers cannot be made to show (each test says which), plus the pure parts. Everything a
real server can serve runs against kube-apiserver 1.20.2: tests/kube_real/test_kube_mode_flow.py
(pods, attestation, quarantine, restart, invalid policies, the trust-bundle ConfigMap) and
tests/kube_real/test_kube_mode_actions.py (eviction, audit mode, the node watch, leader-only
actions). The control plane is set up by tests/kube_real/plane.py for both."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from attestmesh.cli import _check_mode, build_parser
from attestmesh.cli import main as cli_main
from attestmesh.demo import free_port as free_port  # one port picker (see there)
from attestmesh.kube_mode import Work, WorkKind, build_work
from certs.policy import parse_policies
from sidecar.agent import Agent, SimEvidenceSource
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS, ResourceType
from tests.kube_real.plane import (
    BAD,
    GOOD,
    PLATFORM,
    Plane,
    fake_client,
    kube_plane,
    pinned,
    sim_key_file,
    snapshot_of,
)
from tests.polling import until
from tests.unit.xds.test_xds_build import endpoints
from xds.state import Endpoint, Event, EventKind, MeshState, Registration, Status, Trigger, register

eventually = partial(until, every=0.02)

__all__ = ["BAD", "GOOD", "PLATFORM"]  # shared with the other fake-server tests

WEBHOOKS = ResourceType(
    "admissionregistration.k8s.io",
    "v1",
    "mutatingwebhookconfigurations",
    "MutatingWebhookConfiguration",
    False,
)
GROUP = "attestmesh.dev"
WEB_TOKEN = "tok-web"  # web-0's projected token (bound to the pod) the fake TokenReview knows
WORKLOAD = "shop/web-0"
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def policy_cr(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"serviceAccounts": ["web"]},
        "allowedTees": ["sim"],
        "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
    }
    base.update(spec)
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": base,
    }


MESH_POLICY = {
    "apiVersion": "attestmesh.dev/v1alpha1",
    "kind": "MeshPolicy",
    "metadata": {"name": "web-callers", "namespace": "shop"},
    "spec": {
        "destination": {"serviceAccount": "web"},
        "rules": [{"from": [{"serviceAccount": "web"}]}],
    },
}


def pod_obj(name: str = "web-0", ip: str = "10.1.0.5") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "labels": {"app": "web"},
            "annotations": {
                "attestmesh.dev/injected": "true",
                "attestmesh.dev/inbound-port": "15006",
                "attestmesh.dev/app-port": "8080",
            },
        },
        "spec": {
            "serviceAccountName": "web",
            "nodeName": "n1",
            "containers": [{"name": "app", "image": "web:1"}],
        },
        "status": {"phase": "Running", "podIP": ip},
    }


async def seed(kube: FakeKube, *policies: dict[str, Any]) -> None:
    await kube.put_object(
        "namespaces",
        {"metadata": {"name": "shop", "labels": {"attestmesh.dev/inject": "enabled"}}},
    )
    await kube.put_object("nodes", {"metadata": {"name": "n1"}, "spec": {}})
    for p in policies:
        await kube.put_object("attestationpolicies", p, GROUP)
    await kube.put_object("meshpolicies", MESH_POLICY, GROUP)
    await kube.put_object("pods", pod_obj())
    await kube.put_object(
        "mutatingwebhookconfigurations",
        {
            "metadata": {"name": "attestmesh-sidecar-injector"},
            "webhooks": [
                {
                    "name": "inject.attestmesh.dev",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "clientConfig": {
                        "service": {"name": "attestmesh-controlplane", "namespace": "x"}
                    },
                }
            ],
        },
        WEBHOOKS.group,
    )
    kube.add_token(WEB_TOKEN, "shop", "web", pod="web-0")
    kube.add_token("tok-other", "shop", "other")


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_interval=0.1, extra_resources=(WEBHOOKS, CONFIGMAPS)) as k:
        yield k


@pytest.fixture(scope="module")
def sim_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sim_key_file(tmp_path_factory.mktemp("sim"))


class FakePlane(Plane):
    def agent(
        self,
        workload: str = WORKLOAD,
        token: str = WEB_TOKEN,
        measurement: bytes = GOOD,
        source: SimEvidenceSource | None = None,
    ) -> Agent:
        return super().agent(workload, token, measurement, source)


@contextlib.asynccontextmanager
async def control_plane(
    kube: FakeKube, state_dir: Path, sim_key: Path, identity: str = "cp-0"
) -> AsyncIterator[FakePlane]:
    """The control plane against the fake (tests/kube_real/plane.py's set-up)."""
    async with kube_plane(
        fake_client(kube.configuration()), sim_key, state_dir, identity, watch_timeout=5
    ) as plane:
        yield FakePlane(plane.running, plane.mode, plane.settings, plane.task)


def trust_cm(kube: FakeKube, namespace: str) -> dict[str, Any] | None:
    return kube.get("configmaps", namespace, "attestmesh-trust-bundle")


async def test_a_failed_trust_bundle_read_and_a_lost_create_race_are_retried(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    """Fake only: a 503 answering one GET, and a create that lost a race (409) at the moment
    the test chooses; a real server gives neither on demand. The rest of the ConfigMap's life
    runs on the real server (test_kube_mode_flow)."""
    await seed(kube, policy_cr("web"))
    await kube.put_object("namespaces", {"metadata": {"name": "quiet"}})  # not labelled
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        await plane.mode.drained()
        assert trust_cm(kube, "quiet") is None
        kube.fail("GET", "/namespaces/quiet/configmaps/attestmesh-trust-bundle", 503)
        kube.fail("POST", "/namespaces/quiet/configmaps", 409)
        await kube.put_object("namespaces", {"metadata": {"name": "quiet", "labels": {
            "attestmesh.dev/inject": "enabled"}}})  # fmt: skip
        await eventually(lambda: len(kube.fail_next) == 1)  # the read failed
        await plane.mode.drained()
        assert trust_cm(kube, "quiet") is None
        plane.mode.submit(Work(WorkKind.REAPPLY))  # reads again, creates, loses, reads again
        await plane.mode.drained()
        assert not kube.fail_next
        cm = trust_cm(kube, "quiet")
        assert cm is not None and cm["data"] == {
            "root.pem": plane.running.cp.ca.bundle_pem.decode()
        }


LEDGER = "shop/ledger-0"


def ledger_pod(ip: str = "10.1.0.9") -> dict[str, Any]:
    """A pod of the billing Service. Its service account is web and it keeps the annotations
    of ``pod_obj``: neither makes it a member of any mesh service, only the Service does."""
    obj = pod_obj("ledger-0", ip)
    obj["metadata"]["labels"] = {"tier": "billing"}
    return obj


def endpoint_slice(ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "billing-x7k2p",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "billing"},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["10.1.0.9"],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {"kind": "Pod", "name": "ledger-0", "namespace": "shop"},
            }
        ],
        "ports": [{"port": 8080, "protocol": "TCP"}],
    }


async def test_service_and_endpoint_slices_shape_the_callers_endpoints(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    """Fake only: the control plane reads readiness from discovery.k8s.io/v1 EndpointSlices,
    which kube-apiserver 1.20 does not serve (v1beta1 only), and no newer full server can be
    built here (shared/design/KUBE-APISERVER.md). Services, pods and the Envoy configuration
    without slices run on the real server (tests/kube_real/test_controlplane.py)."""
    await seed(kube, policy_cr("web"))
    caller = pod_obj()
    caller["metadata"]["annotations"]["attestmesh.dev/outbound"] = "billing=15001"
    await kube.put_object("pods", caller)
    await kube.put_object("pods", ledger_pod())
    billing = {
        "metadata": {"name": "billing", "namespace": "shop"},
        "spec": {"selector": {"tier": "billing"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    await kube.put_object("services", billing)
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        assert cp.state.get(LEDGER).registration.service == "billing"
        async with aiohttp.ClientSession() as session:
            await plane.agent().attest_once(session)
            kube.add_token("tok-ledger", "shop", "web", pod="ledger-0")
            await plane.agent(token="tok-ledger", workload=LEDGER).attest_once(session)

        def billing_endpoints() -> list[tuple[str, int]]:
            return endpoints(snapshot_of(plane, WORKLOAD), "out|billing")

        assert billing_endpoints() == [("10.1.0.9", 15006)]
        assert pinned(snapshot_of(plane, WORKLOAD), "out|billing") == [
            "spiffe://attestmesh.local/ns/shop/sa/web"
        ]

        # its EndpointSlice says not ready: out of the caller's EDS; ready again: back
        group = "discovery.k8s.io"
        await kube.put_object("endpointslices", endpoint_slice(False), group)
        await eventually(lambda: billing_endpoints() == [])
        assert cp.status_of(LEDGER) is Status.ATTESTED  # still attested, only not routed to
        await kube.put_object("endpointslices", endpoint_slice(True), group)
        await eventually(lambda: billing_endpoints() == [("10.1.0.9", 15006)])

        # its IP changes through the pod watch
        await kube.put_object("pods", ledger_pod("10.1.0.19"))
        await eventually(lambda: billing_endpoints() == [("10.1.0.19", 15006)])

        # the Service goes: the pod serves no mesh service at all (not its service account's
        # name, not a label); it stays registered and attested, and leaves the caller's EDS
        # and CDS pins
        await kube.delete_object("services", "shop", "billing")
        await eventually(lambda: cp.state.get(LEDGER).registration.service == "")
        assert billing_endpoints() == []
        assert cp.status_of(LEDGER) is Status.ATTESTED
        nobody = ["spiffe://attestmesh.local/-/none"]  # a service with no attested member
        await eventually(lambda: pinned(snapshot_of(plane, WORKLOAD), "out|billing") == nobody)
        index = plane.running.publisher.index
        assert index is not None
        assert not any(LEDGER in members for members in index.members.values())

    # a restart keeps readiness from the cluster, not from the persisted state
    await kube.put_object("services", billing)
    await kube.put_object("endpointslices", endpoint_slice(False), "discovery.k8s.io")
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        reg = plane.running.cp.state.get(LEDGER).registration
        assert (reg.service, reg.ready) == ("billing", False)
        assert endpoints(snapshot_of(plane, WORKLOAD), "out|billing") == []


def test_build_work_is_pure_and_only_for_pods() -> None:
    reg = Registration("shop/web-0", "shop", "web", "web", Endpoint("10.0.0.1", 15006), 8080)
    state, _ = register(MeshState("attestmesh.local"), reg, T0)
    local = Registration("local-1", "default", "x", "x", Endpoint("127.0.0.1", 1), 2)
    state, _ = register(state, local, T0)
    (evicting,) = parse_policies([policy_cr("web", onFailure="quarantineAndEvict")])
    (auditing,) = parse_policies(
        [policy_cr("web-audit", mode="audit", onFailure="quarantineAndEvict")]
    )
    evs = [
        Event(
            EventKind.QUARANTINED,
            "shop/web-0",
            T0,
            "tcb_status_not_accepted: Revoked",
            Trigger.TCB_REVOKED,
            "tcb_status_not_accepted",
            platform=True,
        ),
        Event(EventKind.QUARANTINED, "local-1", T0, "x", Trigger.OPERATOR),
        Event(EventKind.RELEASED, "shop/web-0", T0),
        Event(EventKind.AUDIT, "shop/web-0", T0, "measurement_not_allowed: m"),
        Event(EventKind.ATTESTED, "shop/web-0", T0),
    ]
    work = build_work(state, evs, [evicting])
    assert [(w.kind, w.workload) for w in work] == [
        (WorkKind.QUARANTINE, "shop/web-0"),
        (WorkKind.RELEASE, "shop/web-0"),
        (WorkKind.AUDIT, "shop/web-0"),
    ]
    assert work[0].evict and work[0].platform_failed  # typed: authentic platform evidence
    # the reason text decides nothing: a platform-sounding text without the flag taints nothing
    text_only = Event(EventKind.QUARANTINED, "shop/web-0", T0, "tcb_status_not_accepted: x",
                      Trigger.APPRAISAL_FAILED)  # fmt: skip
    assert not build_work(state, [text_only], [evicting])[0].platform_failed
    # an audit-mode policy never evicts; no governing policy: quarantine only
    assert not build_work(state, evs[:1], [auditing])[0].evict
    assert not build_work(state, evs[:1], [])[0].evict


def test_cli_mode_specific_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["controlplane", "--state-dir", str(tmp_path)]) == 2
    assert "--policy is required in local mode" in capsys.readouterr().err
    argv = ["controlplane", "--state-dir", str(tmp_path), "--kubernetes", "--policy", "p.yaml"]
    assert cli_main([*argv, "--webhook-cert", "c.pem"]) == 2
    err = capsys.readouterr().err
    assert "--policy is for local mode" in err
    assert "--webhook-cert and --webhook-key go together" in err
    assert cli_main(["controlplane", "--state-dir", str(tmp_path), "--policy", "p.yaml",
                     "--lease-name", "x"]) == 2  # fmt: skip
    assert "--lease-name needs --kubernetes" in capsys.readouterr().err
    missing = tmp_path / "missing-kubeconfig"
    k = ["controlplane", "--state-dir", str(tmp_path / "s"), "--kubernetes"]
    assert cli_main([*k, "--kubeconfig", str(missing)]) == 2
    assert "kube_config_invalid" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before any state was opened


def test_deployment_args_are_cli_flags() -> None:
    """manifests/base/controlplane.yaml runs exactly what the CLI accepts in Kubernetes mode."""
    root = Path(__file__).resolve().parents[2]
    docs = yaml.safe_load_all((root / "manifests" / "base" / "controlplane.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["attestmesh", "controlplane"]
    env = {"POD_NAMESPACE": "attestmesh-system", "POD_NAME": "attestmesh-controlplane-abc"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    parsed = build_parser().parse_args(["controlplane", *args])
    _check_mode(parsed)  # no mode-specific problem
    assert parsed.kubernetes and parsed.identity == "attestmesh-controlplane-abc"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parsed.api_port == ports["https-attest"] and parsed.xds_port == ports["grpc-xds"]
    assert parsed.webhook_port == ports["https-webhook"]
    assert parsed.probe_port == ports["http-metrics"]
    probe_ports = {container[p]["httpGet"]["port"] for p in ("livenessProbe", "readinessProbe")}
    assert probe_ports == {"http-metrics"}
