"""``attestmesh controlplane --ads-transport``: the real control plane serves mutual-TLS ADS on
either HTTP/2 (the lean default, or the grpclib fallback) to a workload presenting the
certificate it was just issued, and refuses a foreign node."""

from __future__ import annotations

import asyncio
import ssl
import warnings
from pathlib import Path

import aiohttp
import grpclib.const
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpclib.exceptions import GRPCError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.cli import build_parser
from attestmesh.demo import free_port
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from tests.component.test_ads_mtls import first_response
from tests.component.test_agent import RecordingSink
from tests.unit.fixtures_core import MEASUREMENT, policy_doc
from xds.resources import ADS_SERVICE, TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)

PLATFORM = ec.generate_private_key(ec.SECP256R1())
METHOD = f"/{ADS_SERVICE}/StreamAggregatedResources"


def test_the_flag_reaches_the_settings() -> None:
    parser = build_parser()
    base = ["controlplane", "--state-dir", "/tmp/x"]
    assert parser.parse_args(base).ads_transport == "lean"
    assert parser.parse_args([*base, "--ads-transport", "grpclib"]).ads_transport == "grpclib"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--ads-transport", "h3"])


@pytest.mark.parametrize("transport", ["lean", "grpclib"])
async def test_the_control_plane_serves_mtls_ads_on_either_transport(
    tmp_path: Path, transport: str
) -> None:
    pub = tmp_path / "platform.pub"
    pub.write_bytes(PLATFORM.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(policy_doc()))
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(yaml.safe_dump({"workloads": [
        {"name": "web-1", "serviceAccount": "web", "service": "web",
         "inbound": "127.0.0.1:15001", "appPort": 8080},
        {"name": "db-1", "serviceAccount": "db", "service": "db",
         "inbound": "127.0.0.1:15002", "appPort": 8081},
    ]}))  # fmt: skip
    settings = ControlPlaneSettings(
        state_dir=tmp_path / "state", policy_file=policy, registrations_file=workloads,
        allow_unauthenticated_registrations=True, api_port=free_port(),
        xds_port=free_port(), ops_port=free_port(), sim_platform_keys=(pub,),
        ads_transport=transport,
    )  # fmt: skip
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_control_plane(settings, stop, ready))
    try:
        running = await asyncio.wait_for(ready, 20)
        sink = RecordingSink()
        agent = Agent(url=f"https://127.0.0.1:{settings.api_port}", workload="web-1",
                      source=SimEvidenceSource(PLATFORM, MEASUREMENT), sink=sink,
                      ssl_context=client_ssl_context(running.bundle_pem), token=lambda: None,
                      timeout_s=5.0)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await agent.attest_once(session)
        chain, key = sink.updates[-1]
        (tmp_path / "web.pem").write_bytes(chain)
        (tmp_path / "web.key").write_bytes(key)
        ctx = ssl.create_default_context(cadata=running.bundle_pem.decode())
        ctx.set_alpn_protocols(["h2"])
        ctx.load_cert_chain(tmp_path / "web.pem", tmp_path / "web.key")
        resp = await first_response(settings.xds_port, ctx, "web-1")
        assert resp.type_url == TypeUrl.CLUSTER and resp.version_info
        with pytest.raises(GRPCError) as exc:  # its certificate does not name db-1
            await first_response(settings.xds_port, ctx, "db-1")
        assert exc.value.status is grpclib.const.Status.PERMISSION_DENIED
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def test_the_xds_tls_context_refuses_renegotiation_and_requires_a_client_certificate(
    tmp_path: Path,
) -> None:
    from datetime import UTC, datetime

    from attestmesh.serve import _xds_tls
    from certs.ca import CertificateAuthority

    ca = CertificateAuthority.load_or_create(tmp_path / "ca", "attestmesh.local", datetime.now(UTC))
    ctx = _xds_tls(ca)
    assert ctx.options & ssl.OP_NO_RENEGOTIATION
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.num_tickets == 0
