"""manifests/secrets: the opt-in kustomize Component for secret release (OpenBao) and the KBS.

The Component is rendered here as kustomize does for what it uses (its resources added to
those of manifests/, its RFC 6902 patches applied to the targeted objects; checked against
``kubectl kustomize`` when writing it), then: every rendered object validates strictly; the
control plane's flags are CLI flags that turn secret release and the KBS on with the
OpenBao credential read from files of a Secret volume (never argv, never the environment); the
ports the flags open are container ports the Services target by name; and the webhook the CLI
configures from those flags injects agents whose ``--secret-url`` is the Service's secret port,
while the serving certificate names the KBS Service."""

from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from attestmesh import cli
from attestmesh.secret_release import settings_from_args
from certs.kbs import SESSION_TTL
from sidecar.inject import AGENT_CONTAINER, ANNOTATION_SECRETS, LABEL_TEE, Decision, mutate
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.inject.test_inject import ENABLED, container, pod
from tests.unit.manifests.helpers import KUBE_VERSION, MANIFESTS, is_core, load_yaml_docs

COMPONENT = MANIFESTS / "secrets"
ENV = {"POD_NAMESPACE": "attestmesh-system", "POD_NAME": "attestmesh-controlplane-abc"}


def _kustomization(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return doc


def _resources(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for entry in _kustomization(directory).get("resources", []):
        path = (directory / entry).resolve()
        assert COMPONENT not in (path, *path.parents) or directory == COMPONENT
        out += _resources(path) if path.is_dir() else load_yaml_docs(path)
    return out


def _matches(target: dict[str, Any], doc: dict[str, Any]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    return bool(
        target["kind"] == doc["kind"]
        and target["name"] == doc["metadata"]["name"]
        and target.get("group", "") == group
        and target["version"] == version
    )


def render(with_component: bool = True) -> list[dict[str, Any]]:
    docs = copy.deepcopy(_resources(MANIFESTS))
    if not with_component:
        return docs
    component = _kustomization(COMPONENT)
    docs += copy.deepcopy(_resources(COMPONENT))
    for patch in component["patches"]:
        hits = [i for i, d in enumerate(docs) if _matches(patch["target"], d)]
        assert len(hits) == 1, patch["target"]
        docs[hits[0]] = apply_patch(docs[hits[0]], yaml.safe_load(patch["patch"]))
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def controlplane(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", "attestmesh-controlplane")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = c
    return found


def args_of(c: dict[str, Any]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], a) for a in c["args"]]


def test_the_component_is_opt_in_and_the_crd_ships_with_manifests() -> None:
    component = _kustomization(COMPONENT)
    assert component["kind"] == "Component"
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    root = _kustomization(MANIFESTS)
    assert "secrets" not in root.get("resources", []) and "components" not in root
    plain = render(with_component=False)
    assert one(plain, "CustomResourceDefinition", "secretpolicies.attestmesh.dev")
    assert not any(a.startswith("--openbao") for a in controlplane(plain)["args"])
    service = one(plain, "Service", "attestmesh-controlplane")
    assert "https-secrets" not in {p["name"] for p in service["spec"]["ports"]}


def test_rendered_objects_validate_strictly() -> None:
    docs = render()
    core = [d for d in docs if is_core(d["apiVersion"])]
    kinds = {d["kind"] for d in core}
    assert {"Deployment", "Service", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for doc in core:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_flags_turn_on_secret_release_and_the_kbs_with_credentials_from_files() -> None:
    docs = render()
    c = controlplane(docs)
    parsed = cli.build_parser().parse_args(["controlplane", *args_of(c)])
    cli._check_mode(parsed)
    s = settings_from_args(parsed)
    assert s is not None and s.policy_file is None  # Kubernetes mode: SecretPolicy resources
    assert urlsplit(s.openbao_url).scheme == "https"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert s.port == ports["https-secrets"] and s.kbs_port == ports["https-kbs"]
    assert len(set(ports.values())) == len(ports)  # no port opened twice
    # the credential: files of a Secret volume, mounted read-only; nothing in env or argv
    spec = one(docs, "Deployment", "attestmesh-controlplane")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert s.approle is not None and s.token_file is None and s.openbao_ca is not None
    for path, source in ((s.approle[0], "secret"), (s.approle[1], "secret"),
                         (s.openbao_ca, "configMap")):  # fmt: skip
        mount = mounts[path.parent.as_posix()]
        assert mount["readOnly"] is True
        volume = volumes[mount["name"]]
        assert source in volume and volume[source]["defaultMode"] & 0o222 == 0
        assert path.name in {i["path"] for i in volume[source]["items"]}
    (credential,) = [v for v in volumes.values() if "secret" in v]
    assert credential["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    env = c.get("env", [])
    assert not [e for e in env if re.search("BAO|VAULT|APPROLE|SECRET_ID", e["name"])]
    assert not [a for a in c["args"] if re.search(r"token=(?!/)|secret-id=(?!/)", a)]


def test_services_target_the_opened_ports_by_name() -> None:
    docs = render()
    c = controlplane(docs)
    labels = one(docs, "Deployment", "attestmesh-controlplane")["spec"]["template"]["metadata"][
        "labels"
    ]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    main = one(docs, "Service", "attestmesh-controlplane")
    (secret,) = [p for p in main["spec"]["ports"] if p["name"] == "https-secrets"]
    assert secret["targetPort"] == "https-secrets" and secret["port"] == named["https-secrets"]
    assert "https-kbs" not in {p["name"] for p in main["spec"]["ports"]}
    assert main["spec"].get("sessionAffinity", "None") == "None"  # the main Service unchanged
    kbs = one(docs, "Service", "attestmesh-controlplane-kbs")
    assert kbs["metadata"]["namespace"] == main["metadata"]["namespace"]
    assert kbs["spec"]["selector"].items() <= labels.items()
    (port,) = kbs["spec"]["ports"]
    assert port["targetPort"] == "https-kbs" and port["name"] in named
    # a KBS session is one replica's: the client stays on it for longer than a session
    assert kbs["spec"]["sessionAffinity"] == "ClientIP"
    timeout = kbs["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"]
    assert timeout >= SESSION_TTL.total_seconds()


def test_injected_agents_use_the_secret_port_and_the_kbs_service_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI run with the rendered flags (Kubernetes and the servers replaced by recorders)."""
    import attestmesh.kube_mode as kube_mode
    import attestmesh.serve as serve

    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, kube: object, settings: Any, *args: object, **kw: object) -> None:
            seen["kube"] = settings

        def hooks(self) -> None:
            return None

    async def run(settings: Any, stop: asyncio.Event, **kw: object) -> None:
        seen["settings"] = settings

    monkeypatch.setattr(kube_mode, "connect", lambda *a: None)
    monkeypatch.setattr(kube_mode, "KubeMode", Recorder)
    monkeypatch.setattr(serve, "run_control_plane", run)
    monkeypatch.setenv("ATTESTMESH_STORE", "postgresql://mesh@db.example:5432/mesh")
    docs = render()
    parsed = cli.build_parser().parse_args(["controlplane", *args_of(controlplane(docs))])
    assert cli._controlplane(parsed) == 0
    inject = seen["kube"].inject
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_SECRETS] = "db"
    result = mutate(p, {**ENABLED, LABEL_TEE: "sev-snp"}, inject)
    assert result.decision is Decision.INJECTED, result.message
    out = apply_patch(copy.deepcopy(p), [dict(op) for op in result.patch])
    agent = cli.build_parser().parse_args(
        [a.replace("$(POD_NAMESPACE)/$(POD_NAME)", "shop/web-0")
         for a in container(out, AGENT_CONTAINER)["command"][1:]]
    )  # fmt: skip
    url = urlsplit(agent.secret_url)
    main = one(docs, "Service", "attestmesh-controlplane")
    ns = main["metadata"]["namespace"]
    assert url.scheme == "https" and url.hostname == f"{main['metadata']['name']}.{ns}.svc"
    service_ports = {p["port"]: p["name"] for p in main["spec"]["ports"]}
    assert service_ports[url.port] == "https-secrets"
    names = seen["settings"].server_names
    assert f"{main['metadata']['name']}.{ns}.svc" in names
    assert f"attestmesh-controlplane-kbs.{ns}.svc" in names
    assert f"attestmesh-controlplane-kbs.{ns}.svc.cluster.local" in names
