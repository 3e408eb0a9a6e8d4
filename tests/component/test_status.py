"""``attestmesh status``: the rows (pure), the xDS sync state the ADS server records per node and
type (a fake Envoy over in-memory gRPC: STALE until ACKed, SYNCED, NACKED, gone when the stream
closes), and the whole path: a control plane process (run_control_plane, local mode, sim TEE),
a real agent, the ops endpoint behind its token, the CLI table and --json."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh import status_cmd
from attestmesh.metrics import Metrics
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from certs.errors import AttestmeshError
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from tests.component.test_ads import envoy, snap
from tests.component.test_agent import RecordingSink
from tests.unit.fixtures_core import MEASUREMENT, policy_doc
from tests.unit.xds.meshfixture import NOW, two_workloads
from xds import sync_status
from xds.cache import SnapshotCache
from xds.resources import TypeUrl
from xds.state import Status, TcbDeferral, Trigger, quarantine, set_tcb_deferrals


def test_rows_show_tee_measurement_certificate_attestation_and_quarantine() -> None:
    state = two_workloads()
    state, _ = quarantine(state, "backend", Trigger.TCB_CHANGED, "tcb_status_not_accepted: "
                          "OutOfDate", NOW, code="tcb_status_not_accepted")  # fmt: skip
    sync = {"frontend": {"cds": "SYNCED", "lds": "NACKED"}}
    rows = status_cmd.status_rows(state, sync, NOW + timedelta(minutes=5))
    front, back = sorted(rows, key=lambda r: r["name"], reverse=True)
    assert front["name"] == "frontend" and front["status"] == "attested"
    assert front["tee"] == "sim" and front["measurement"] == "-"  # the fixture records none
    assert front["certificate_expires"] == (NOW + timedelta(hours=1)).isoformat()
    assert front["certificate_expires_in_s"] == 55 * 60
    assert front["xds"] == {"cds": "SYNCED", "eds": "-", "lds": "NACKED", "rds": "-", "sds": "-"}
    assert front["xds_connected"] is True and front["quarantine"] is None
    assert front["last_attested"] is not None
    assert back["status"] == "quarantined" and back["xds_connected"] is False
    assert back["quarantine"]["trigger"] == "tcb_changed"
    assert back["xds"] == dict.fromkeys(status_cmd.XDS_TYPES)
    out = io.StringIO()
    status_cmd.render(rows, NOW + timedelta(minutes=5), out)
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:5] == ["NAME", "NAMESPACE", "TEE", "MEASUREMENT", "STATUS"]
    assert "NACKED" in lines[2] and "tcb_changed: tcb_status_not_accepted: OutOfDate" in lines[1]
    assert status_cmd.short_measurement({}) == "-"
    assert status_cmd.short_measurement({"mrtd": "ab" * 48}) == "ab" * 6


def test_rows_show_a_deferred_tcb_quarantine() -> None:
    state = two_workloads()
    w = state.get("frontend")
    assert w.attestation is not None
    deferral = TcbDeferral(NOW + timedelta(minutes=30), w.attestation.evidence_sha256,
                           "tcb_status_not_accepted: OutOfDate", "tcb_status_not_accepted")  # fmt: skip
    state, changed = set_tcb_deferrals(state, {"frontend": deferral})
    assert changed == ["frontend"]
    rows = status_cmd.status_rows(state, {}, NOW + timedelta(minutes=5))
    front, back = sorted(rows, key=lambda r: r["name"], reverse=True)
    assert front["status"] == "attested" and front["quarantine"] is None
    assert front["tcb_quarantine"] == {
        "at": (NOW + timedelta(minutes=30)).isoformat(),
        "reason": "tcb_status_not_accepted: OutOfDate",
        "revoked": False,
    }
    assert back["tcb_quarantine"] is None
    out = io.StringIO()
    status_cmd.render(rows, NOW + timedelta(minutes=5), out)
    (line,) = [ln for ln in out.getvalue().splitlines() if ln.startswith("frontend")]
    assert line.endswith("tcb: in 25m00s unless re-attested: tcb_status_not_accepted: OutOfDate")


async def test_the_ads_server_records_each_nodes_sync_state_per_type() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    cache.set_snapshot("frontend", snap(two_workloads()))
    async with envoy(cache, metrics) as fake:
        await fake.send(TypeUrl.CLUSTER)
        cds = await fake.recv()
        assert sync_status.node_states(cache) == {"frontend": {"cds": "STALE"}}
        await fake.send(TypeUrl.CLUSTER, ack=cds)
        await fake.send(TypeUrl.LISTENER)
        lds = await fake.recv()
        assert sync_status.node_states(cache)["frontend"] == {"cds": "SYNCED", "lds": "STALE"}
        await fake.send(TypeUrl.LISTENER, version="old", nonce=lds.nonce, error="bad filter")
        await asyncio.sleep(0.05)
        assert sync_status.node_states(cache)["frontend"]["lds"] == "NACKED"
    await asyncio.sleep(0.05)
    assert "frontend" not in sync_status.node_states(cache)  # the stream closed


async def test_delta_streams_report_their_sync_state_too() -> None:
    from tests.component import test_ads_delta as delta

    cache, metrics = SnapshotCache(), Metrics()
    cache.set_snapshot("frontend", delta.snap(delta.three_workloads()))
    async with delta.envoy(cache, metrics) as fake:
        await fake.send(TypeUrl.CLUSTER, ["*"])
        cds = await fake.recv()
        assert sync_status.node_states(cache)["frontend"] == {"cds": "STALE"}
        await fake.ack(cds)
        await fake.send(TypeUrl.LISTENER, ["*"])
        lds = await fake.recv()
        await fake.send(TypeUrl.LISTENER, nonce=lds.nonce, error="bad listener")
        await asyncio.sleep(0.05)
        assert sync_status.node_states(cache)["frontend"] == {"cds": "SYNCED", "lds": "NACKED"}
    await asyncio.sleep(0.05)
    assert sync_status.node_states(cache) == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PLATFORM = ec.generate_private_key(ec.SECP256R1())


async def test_status_of_a_running_control_plane(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    pub = tmp_path / "platform.pub"
    pub.write_bytes(PLATFORM.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(policy_doc()))
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(yaml.safe_dump({"workloads": [
        {"name": "web-1", "serviceAccount": "web", "service": "web",
         "inbound": "127.0.0.1:15001", "appPort": 8080},
        {"name": "web-2", "serviceAccount": "web", "service": "web",
         "inbound": "127.0.0.1:15002", "appPort": 8081},
    ]}))  # fmt: skip
    state = tmp_path / "state"
    settings = ControlPlaneSettings(
        state_dir=state, policy_file=policy, registrations_file=workloads,
        allow_unauthenticated_registrations=True, api_port=_free_port(),
        xds_port=_free_port(), ops_port=_free_port(), sim_platform_keys=(pub,),
    )  # fmt: skip
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_control_plane(settings, stop, ready))
    try:
        running = await asyncio.wait_for(ready, 20)
        agent = Agent(url=f"https://127.0.0.1:{settings.api_port}", workload="web-1",
                      source=SimEvidenceSource(PLATFORM, MEASUREMENT), sink=RecordingSink(),
                      ssl_context=client_ssl_context(running.bundle_pem), token=lambda: None,
                      timeout_s=5.0)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            cert = await agent.attest_once(session)
        running.cp.quarantine("web-2", Trigger.OPERATOR, "maintenance")

        def cli(*extra: str) -> str:
            parser = argparse.ArgumentParser()
            status_cmd.add_parser(parser.add_subparsers())
            args = parser.parse_args(["status", "--ops-port", str(settings.ops_port), *extra])
            out = io.StringIO()
            assert status_cmd.run(args, out) == 0
            return out.getvalue()

        rows = json.loads(await asyncio.to_thread(cli, "--state-dir", str(state), "--json"))
        web1, web2 = rows
        assert web1["name"] == "web-1" and web1["status"] == Status.ATTESTED.value
        assert web1["tee"] == "sim" and web1["measurement"] == MEASUREMENT.hex()[:12]
        assert web1["certificate_expires"] == cert.not_after.isoformat()
        assert 0 < web1["certificate_expires_in_s"] <= 3600
        assert web1["xds_connected"] is False  # no Envoy connected in this test
        assert web2["status"] == "quarantined"
        assert web2["quarantine"]["trigger"] == "operator"
        assert web2["quarantine"]["reason"] == "maintenance"
        table = await asyncio.to_thread(cli, "--state-dir", str(state))
        assert "web-1" in table and "attested" in table and "operator: maintenance" in table
        # the ops endpoint needs the token
        with pytest.raises(AttestmeshError) as err:
            await asyncio.to_thread(cli)
        assert err.value.reason == "ops_unauthenticated"
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert datetime.now(UTC) < cert.not_after
