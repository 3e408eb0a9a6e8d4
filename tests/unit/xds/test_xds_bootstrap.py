"""The sidecar bootstrap, and the built resources, as Envoy itself validates them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic.warnings import PydanticDeprecatedSince212

from sidecar.bootstrap import ControlPlaneAddress, build_bootstrap, render_bootstrap
from tests.integration.envoy_harness import validate_config
from tests.unit.xds.meshfixture import TRUST, allow, two_workloads
from xds.build import build_snapshot
from xds.meshpolicy import HttpMatch
from xds.resources import TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.google.protobuf import Any as AnyMsg


def bootstrap(sock: Path) -> dict[str, Any]:
    return build_bootstrap("frontend", ControlPlaneAddress("127.0.0.1", 18000), sock, 19000)


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


@pytest.mark.integration
def test_envoy_accepts_bootstrap(tmp_path: Path) -> None:
    path = tmp_path / "bootstrap.json"
    path.write_text(render_bootstrap(bootstrap(tmp_path / "sds.sock")))
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
