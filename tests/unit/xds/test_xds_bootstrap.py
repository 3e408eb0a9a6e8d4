"""The sidecar bootstrap, and the built resources, as Envoy itself validates them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.cli import main
from sidecar.bootstrap import (
    ControlPlaneAddress,
    XdsProtocol,
    XdsTls,
    build_bootstrap,
    render_bootstrap,
)
from tests.integration.envoy_harness import validate_config
from tests.unit.xds.meshfixture import TRUST, allow, two_workloads
from xds.build import build_snapshot
from xds.meshpolicy import HttpMatch
from xds.resources import WORKLOAD_CERT, WORKLOAD_LEAF_CERT, TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.google.protobuf import Any as AnyMsg


def bootstrap(sock: Path, **kwargs: Any) -> dict[str, Any]:
    return build_bootstrap(
        "frontend", ControlPlaneAddress("127.0.0.1", 18000), sock, 19000, **kwargs
    )


def test_bootstrap_shape(tmp_path: Path) -> None:
    b = bootstrap(tmp_path / "sds.sock")
    assert b["node"]["id"] == "frontend"
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19000}
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    assert set(clusters) == {"xds", "sds-local"}
    for c in clusters.values():  # gRPC needs HTTP/2 on both
        opts = c["typed_extension_protocol_options"]
        (proto,) = opts.values()
        assert proto["explicit_http_config"] == {"http2_protocol_options": {}}
    sds_addr = clusters["sds-local"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert sds_addr["endpoint"]["address"] == {"pipe": {"path": str(tmp_path / "sds.sock")}}
    dyn = b["dynamic_resources"]
    assert dyn["ads_config"]["grpc_services"] == [{"envoy_grpc": {"cluster_name": "xds"}}]
    assert dyn["lds_config"]["ads"] == {} and dyn["cds_config"]["ads"] == {}
    assert json.loads(render_bootstrap(b)) == b


def test_ads_is_delta_by_default_and_sotw_on_request(tmp_path: Path) -> None:
    delta = bootstrap(tmp_path / "sds.sock")
    assert delta["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"
    sotw = bootstrap(tmp_path / "sds.sock", xds_protocol=XdsProtocol.SOTW)
    assert sotw["dynamic_resources"]["ads_config"]["api_type"] == "GRPC"
    # only the ADS variant differs; the local SDS (a SotW server in the sidecar) stays GRPC
    sotw["dynamic_resources"]["ads_config"]["api_type"] = "DELTA_GRPC"
    assert sotw == delta
    tls = XdsTls(tmp_path / "root.pem", "spiffe://mesh.test/controlplane")
    with_tls = bootstrap(tmp_path / "sds.sock", xds_tls=tls)
    (xds,) = [c for c in with_tls["static_resources"]["clusters"] if c["name"] == "xds"]
    common = xds["transport_socket"]["typed_config"]["common_tls_context"]
    (cert_source,) = common["tls_certificate_sds_secret_configs"]
    assert cert_source["sds_config"]["api_config_source"]["api_type"] == "GRPC"


def test_ads_presents_the_leaf_alone_and_the_mesh_the_full_chain(tmp_path: Path) -> None:
    """The ADS cluster takes the leaf-only secret from the local SDS (the control plane trusts
    the intermediates); the mesh's listeners and clusters keep the full chain (their peers
    trust the root alone)."""
    tls = XdsTls(tmp_path / "root.pem", "spiffe://mesh.test/controlplane")
    with_tls = bootstrap(tmp_path / "sds.sock", xds_tls=tls)
    (xds,) = [c for c in with_tls["static_resources"]["clusters"] if c["name"] == "xds"]
    common = xds["transport_socket"]["typed_config"]["common_tls_context"]
    (cert_source,) = common["tls_certificate_sds_secret_configs"]
    assert cert_source["name"] == WORKLOAD_LEAF_CERT
    snap = build_snapshot(two_workloads(), "frontend", [allow("frontend", "backend")], TRUST)
    packed = b"".join(
        raw for t in (TypeUrl.LISTENER, TypeUrl.CLUSTER) for raw in snap.get(t).values()
    )
    assert WORKLOAD_CERT.encode() in packed
    assert WORKLOAD_LEAF_CERT.encode() not in packed


@pytest.mark.parametrize(
    ("flag", "api_type"),
    [
        ([], "DELTA_GRPC"),
        (["--xds-protocol", "delta"], "DELTA_GRPC"),
        (["--xds-protocol", "sotw"], "GRPC"),
    ],
)
def test_cli_xds_protocol_flag(tmp_path: Path, flag: list[str], api_type: str) -> None:
    out = tmp_path / "envoy.json"
    args = ["bootstrap", "--node", "web", "--xds", "127.0.0.1:18000", "--sds-socket", "s",
            "--xds-plaintext", "-o", str(out), *flag]  # fmt: skip
    assert main(args) == 0
    assert json.loads(out.read_text())["dynamic_resources"]["ads_config"]["api_type"] == api_type


def test_cli_refuses_an_unknown_xds_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bootstrap", "--node", "w", "--xds", "127.0.0.1:1", "--sds-socket", "s",
              "--xds-plaintext", "--xds-protocol", "rest"])  # fmt: skip
    assert exc.value.code == 2
    assert "--xds-protocol" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize("protocol", list(XdsProtocol))
def test_envoy_accepts_bootstrap(tmp_path: Path, protocol: XdsProtocol) -> None:
    path = tmp_path / "bootstrap.json"
    path.write_text(render_bootstrap(bootstrap(tmp_path / "sds.sock", xds_protocol=protocol)))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_envoy_accepts_built_resources(tmp_path: Path) -> None:
    """Listeners and clusters of a real snapshot, placed in static_resources next to the
    bootstrap, pass ``envoy --mode validate`` (RBAC, TLS, SDS and RDS references included)."""
    to = HttpMatch(frozenset({8443}), ("/api",), frozenset({"GET", "POST"}))
    snap = build_snapshot(two_workloads(), "frontend", [allow("frontend", "backend", to)], TRUST)

    def dicts(t: TypeUrl) -> list[dict[str, Any]]:
        out = []
        for raw in snap.get(t).values():
            d = AnyMsg.parse(raw).to_dict()  # proto3 JSON (camelCase) is what Envoy reads
            d.pop("@type")
            out.append(d)
        return out

    b = bootstrap(tmp_path / "sds.sock")
    b["static_resources"]["clusters"].extend(dicts(TypeUrl.CLUSTER))
    b["static_resources"]["listeners"] = dicts(TypeUrl.LISTENER)
    path = tmp_path / "full.json"
    path.write_text(json.dumps(b))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
