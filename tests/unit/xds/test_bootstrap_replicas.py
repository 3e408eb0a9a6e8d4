"""The Envoy bootstrap with several control-plane replicas: each is an endpoint of the ADS
cluster (Envoy validates it), names are resolved (STRICT_DNS), TCP keepalives; the CLI takes a
comma-separated list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trustme

from attestmesh.cli import main
from sidecar.bootstrap import (
    ControlPlaneAddress,
    XdsTls,
    build_bootstrap,
    control_plane_addresses,
    render_bootstrap,
)
from tests.integration.envoy_harness import validate_config


def xds_cluster(b: dict[str, object]) -> dict[str, object]:
    clusters = b["static_resources"]["clusters"]  # type: ignore[index]
    return next(c for c in clusters if c["name"] == "xds")  # type: ignore[no-any-return]


def endpoints(cluster: dict[str, object]) -> list[tuple[str, int]]:
    (group,) = cluster["load_assignment"]["endpoints"]  # type: ignore[index]
    return [
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for e in group["lb_endpoints"]
    ]  # fmt: skip


def test_every_replica_is_an_endpoint_of_the_ads_cluster(tmp_path: Path) -> None:
    replicas = [ControlPlaneAddress("127.0.0.1", 18000), ControlPlaneAddress("127.0.0.2", 18001)]
    b = build_bootstrap("web", replicas, tmp_path / "sds.sock", 19000)
    c = xds_cluster(b)
    assert endpoints(c) == [("127.0.0.1", 18000), ("127.0.0.2", 18001)]
    assert c["type"] == "STATIC"
    assert c["upstream_connection_options"]["tcp_keepalive"]["keepalive_time"] == 10  # type: ignore[index]
    one = build_bootstrap("web", replicas[0], tmp_path / "sds.sock", 19000)
    assert endpoints(xds_cluster(one)) == [("127.0.0.1", 18000)]
    with pytest.raises(ValueError):
        build_bootstrap("web", [], tmp_path / "sds.sock", 19000)


def test_names_are_resolved_and_envoy_accepts_the_bootstrap(tmp_path: Path) -> None:
    b = build_bootstrap(
        "web",
        control_plane_addresses("cp-0.cp.attestmesh-system.svc:18000,10.0.0.7:18000"),
        tmp_path / "sds.sock",
        19000,
        xds_tls=XdsTls(tmp_path / "root.pem", "spiffe://mesh/ns/attestmesh-system/sa/cp"),
    )
    c = xds_cluster(b)
    assert c["type"] == "STRICT_DNS"
    assert endpoints(c) == [("cp-0.cp.attestmesh-system.svc", 18000), ("10.0.0.7", 18000)]
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "root.pem"))
    config = tmp_path / "bootstrap.json"
    config.write_text(render_bootstrap(b))
    checked = validate_config(config)
    assert checked.returncode == 0, checked.stderr[-2000:]


def test_address_lists_parse_or_are_refused() -> None:
    assert control_plane_addresses("a:1, [::1]:2,a:1") == (
        ControlPlaneAddress("a", 1),
        ControlPlaneAddress("::1", 2),
    )
    for bad in ("a", "a:", ":1", "a:1,", "a:0", "a:70000", "a:x"):
        with pytest.raises(ValueError):
            control_plane_addresses(bad)


def test_the_cli_takes_several_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    code = main(["bootstrap", "--node", "web", "--xds", "127.0.0.1:18000,127.0.0.2:18000",
                 "--sds-socket", "s", "--xds-plaintext", "-o", str(out)])  # fmt: skip
    assert code == 0
    assert endpoints(xds_cluster(json.loads(out.read_text()))) == [
        ("127.0.0.1", 18000),
        ("127.0.0.2", 18000),
    ]
    assert main(["bootstrap", "--node", "w", "--xds", "a:1,b", "--sds-socket", "s",
                 "--xds-plaintext"]) != 0  # fmt: skip
    assert "--xds must be host:port" in capsys.readouterr().err
