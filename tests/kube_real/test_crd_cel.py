"""The CRDs of manifests/crds with their CEL rules (x-kubernetes-validations) applied to a real
apiextensions-apiserver 1.36.4 (built by tools/kube-build from Debian sid's Go libraries; 1.20
drops the rules): every example resource is accepted, and every deliberate cross-field mistake
the shared parsers reject (certs/policy.py, xds/meshpolicy.py; tests/unit/manifests/
test_cel_rules.py evaluates the same rules offline with cel-python) is rejected by the real
server with the rule's message."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from certs.errors import PolicyError
from certs.policy import parse_policies
from tests.kube_real.cluster import Cluster, CrdServer
from tests.kube_real.install import MANIFESTS
from tests.kube_real.rest import Rest, load_docs, wait_for
from xds.meshpolicy import parse_mesh_policies
from xds.secretpolicy import parse_secret_policies

pytestmark = pytest.mark.integration

CRDS = [
    MANIFESTS / "crds" / f"{n}.attestmesh.dev.yaml"
    for n in ("attestationpolicies", "meshpolicies", "secretpolicies")
]
EXAMPLES = load_docs(
    [
        MANIFESTS / "examples" / "attestationpolicies.yaml",
        MANIFESTS / "examples" / "meshpolicies.yaml",
        MANIFESTS / "examples" / "secretpolicies.yaml",
    ]
)
GPU = {"measurements": {"2": ["00" * 48]}}


@pytest.fixture(scope="module")
def crd_server(
    cluster: Cluster, admin: Rest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[CrdServer, Rest]]:
    """apiextensions-apiserver 1.36 delegating to the session's kube-apiserver (its core API)."""
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
    server = CrdServer(tmp_path_factory.mktemp("apiext"), cluster.admin, cluster.pki, cluster.bins)
    server.start()
    rest = Rest(server.admin)
    try:
        for doc in load_docs(CRDS):
            rest.apply(doc)

        def established() -> bool:
            for doc in load_docs(CRDS):
                obj = rest.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
                               doc["metadata"]["name"])  # fmt: skip
                conds = {
                    c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])
                }
                if conds.get("Established") != "True":
                    return False
            rest.forget_discovery()
            return True

        wait_for(established, 30, "CRDs established")
        yield server, rest
    finally:
        rest.close()
        server.stop()


def example(name: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for d in EXAMPLES if d["metadata"]["name"] == name))


def post(rest: Rest, doc: dict[str, Any], name: str) -> tuple[int, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = name
    return rest.status_of("POST", rest.doc_path(doc, named=False), doc)


def parse(doc: dict[str, Any]) -> None:
    if doc["kind"] == "MeshPolicy":
        parse_mesh_policies([doc])
    elif doc["kind"] == "SecretPolicy":
        parse_secret_policies([doc])
    else:
        parse_policies([doc])


@pytest.mark.parametrize("doc", EXAMPLES, ids=[d["metadata"]["name"] for d in EXAMPLES])
def test_every_example_is_accepted_by_the_1_36_server(
    crd_server: tuple[CrdServer, Rest], doc: dict[str, Any]
) -> None:
    _, rest = crd_server
    status, body = post(rest, doc, doc["metadata"]["name"])
    assert status == 200, body
    assert body["spec"] == doc["spec"]  # nothing pruned


def _tdx(changes: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        if "nvidia-gpu" in changes.get("allowedTees", ()):
            spec["referenceValues"]["nvidiaGpu"] = GPU
        if "sgx" in changes.get("allowedTees", ()):
            spec["referenceValues"]["sgx"] = {"mrenclave": ["00" * 32]}
        spec.update(changes)

    return change


def _keep(section: str, keep: set[str]) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        ref = spec["referenceValues"][section]
        spec["referenceValues"][section] = {k: v for k, v in ref.items() if k in keep}

    return change


def _interval(ttl: str | None, interval: str) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        spec.pop("certificateTTL")
        if ttl is not None:
            spec["certificateTTL"] = ttl
        spec["reattestationInterval"] = interval

    return change


# (example, change, the CRD rule's message, what the parser says)
MISTAKES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("nitro-enclave", lambda s: s["allowedTees"].append("tdx"),
     "referenceValues.tdx is required because tdx is allowed", "required because tdx is allowed"),
    ("nitro-enclave", _interval("10m", "30m"),
     "reattestationInterval must not exceed certificateTTL", "must not exceed certificateTTL"),
    ("nitro-enclave", _interval(None, "2h"),
     "reattestationInterval must not exceed certificateTTL", "must not exceed certificateTTL"),
    ("sev-snp-cvm", _keep("sevSnp", {"minimumTcb", "minimumGuestSvn"}),
     "at least one reference measurement is required", "at least one reference measurement"),
    ("tdx-td", _keep("tdx", {"acceptedTcbStatuses"}),
     "at least one reference measurement is required", "at least one reference measurement"),
    ("sgx-enclave", _keep("sgx", {"productId", "acceptedTcbStatuses"}),
     "at least one reference measurement is required", "at least one reference measurement"),
    ("nvidia-gpu", lambda s: s["referenceValues"]["nvidiaGpu"]["measurements"].update(fw=["00"]),
     "keys must be measurement indexes (digits)", "index must be a number"),
    ("enclave-app-callers", lambda s: s["rules"][1]["from"][0].update(namespace="demo"),
     "identity stands alone; namespace goes with serviceAccount", "identity must stand alone"),
    ("tdx-td", _tdx({"tcbChangeGracePeriod": "10m"}),
     "tcbChangeGracePeriod only applies with onTcbChange quarantine", "only applies with onTcbChange: quarantine"),
    ("tdx-td", _tdx({"onTcbChange": "audit", "tcbChangeGracePeriod": "1h"}),
     "tcbChangeGracePeriod only applies with onTcbChange quarantine", "only applies with"),
    ("tdx-td", _tdx({"onTcbChange": "quarantine", "tcbChangeGracePeriod": "721h"}),
     "tcbChangeGracePeriod must not exceed 720h", "must not exceed 720h"),
    ("tdx-td", _tdx({"requires": ["tdx", "nvidia-gpu"]}),
     "every TEE in requires must be in allowedTees", "nvidia-gpu is required but not in allowedTees"),
    ("tdx-td", _tdx({"allowedTees": ["tdx", "sgx"], "requires": ["tdx", "sgx"]}),
     "requires names at most one CPU TEE", "at most one CPU TEE"),
    ("tdx-td", _tdx({"allowedTees": ["tdx", "nvidia-gpu"], "requires": ["nvidia-gpu"]}),
     "nvidia-gpu in requires needs a CPU TEE to attach to", "needs a CPU TEE"),
]  # fmt: skip


def _kv_path(path: str) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        spec["secrets"][0]["kv"]["path"] = path

    return change


# SecretPolicy paths: the schema's own pattern and length (RE2 on the server, re in the parser)
SCHEMA_MISTAKES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("payments", _kv_path("/".join(["s"] * 17)), "must match"),
    ("payments", _kv_path("/".join(["x" * 128] * 16) + "y"), "at most 2063 characters"),
    ("payments", _kv_path("../etc"), "must match"),
]
ACCEPTED_CHANGES = [
    _tdx({"onTcbChange": "quarantine", "tcbChangeGracePeriod": "24h"}),
    _tdx({"onTcbChange": "audit"}),
    _tdx({"allowedTees": ["tdx", "nvidia-gpu"], "requires": ["tdx", "nvidia-gpu"]}),
    _interval("1h", "30m"),
]


@pytest.mark.parametrize(("name", "change", "rule_message", "parser_message"), MISTAKES)
def test_each_mistake_the_parser_rejects_the_1_36_server_rejects_with_the_rule(
    crd_server: tuple[CrdServer, Rest],
    name: str,
    change: Callable[[dict[str, Any]], None],
    rule_message: str,
    parser_message: str,
) -> None:
    _, rest = crd_server
    doc = example(name)
    change(doc["spec"])
    with pytest.raises(PolicyError, match=parser_message):
        parse(doc)
    status, body = post(rest, doc, "broken")
    assert status == 422, body
    assert body["reason"] == "Invalid" and rule_message in body["message"], body["message"]
    assert rest.get_or_none(doc["apiVersion"], doc["kind"], "demo", "broken") is None


@pytest.mark.parametrize("change", ACCEPTED_CHANGES)
def test_valid_cross_field_combinations_are_accepted_by_both(
    crd_server: tuple[CrdServer, Rest], change: Callable[[dict[str, Any]], None]
) -> None:
    _, rest = crd_server
    doc = example("tdx-td" if change.__qualname__.startswith("_tdx") else "nitro-enclave")
    change(doc["spec"])
    parse(doc)
    status, body = post(rest, doc, f"ok-{ACCEPTED_CHANGES.index(change)}")
    assert status == 200, body


@pytest.mark.parametrize(("name", "change", "parser_message"), SCHEMA_MISTAKES)
def test_secret_policy_path_mistakes_are_rejected_by_both(
    crd_server: tuple[CrdServer, Rest],
    name: str,
    change: Callable[[dict[str, Any]], None],
    parser_message: str,
) -> None:
    _, rest = crd_server
    doc = example(name)
    change(doc["spec"])
    with pytest.raises(PolicyError, match=parser_message):
        parse(doc)
    status, body = post(rest, doc, "broken-path")
    assert status == 422, body
    assert "spec.secrets[0].kv.path" in body["message"], body["message"]


def test_a_secret_policy_path_of_16_segments_of_128_is_accepted_by_both(
    crd_server: tuple[CrdServer, Rest],
) -> None:
    _, rest = crd_server
    doc = example("payments")
    _kv_path("/".join(["x" * 128] * 16))(doc["spec"])
    parse(doc)
    status, body = post(rest, doc, "long-path")
    assert status == 200, body
