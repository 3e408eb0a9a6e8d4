"""The attested control plane (attestmesh.cp_attest): the control plane serves evidence of its
own (simulated) TEE bound to its TLS serving key; ``verify-controlplane`` and the agent's gate
check it against a policy. Simulated TEE on both sides over real TLS on loopback; the real
evidence formats (SEV-SNP report, TDX quote) through the same parse/verify path."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import tests.unit.evidence.dcap_fixtures as fx
from attestmesh import cp_attest
from attestmesh.cp_attest import (
    ControlPlaneAttestationError,
    ControlPlaneGate,
    SelfAttestation,
    check_attestation,
    parse_response,
    verify_controlplane,
)
from attestmesh.serve import (
    ControlPlaneSettings,
    Running,
    _api_tls,
    _load_server_cert,
    control_plane_spiffe_id,
    run_control_plane,
)
from certs.ca import CertificateAuthority
from certs.evidence.claims import Tee
from certs.evidence.sev_snp import SevSnpVerifier
from certs.evidence.sim import SimVerifier
from certs.evidence.tdx import TdxVerifier
from certs.policy import parse_policies
from sidecar.agent import Agent, AgentError, Evidence, SimEvidenceSource, client_ssl_context
from tests.component.test_agent import RecordingSink
from tests.unit.evidence.test_sev_snp import GENOA, IDBLOCK, MILAN, MILAN_VLEK
from tests.unit.fixtures_core import (
    MEASUREMENT,
    MEASUREMENT_HEX,
    OTHER_MEASUREMENT,
    policy_doc,
    registration,
)

TD = "mesh.example"
CP_ID = control_plane_spiffe_id(TD)
PLATFORM = ec.generate_private_key(ec.SECP256R1())
VERIFIERS = {Tee.SIM: SimVerifier([PLATFORM.public_key()])}
POLICY = parse_policies([policy_doc("cp", "attestmesh-system", service_accounts=["controlplane"])])


@dataclass
class Served:
    url: str
    ca: CertificateAuthority
    self_attestation: SelfAttestation
    contexts: list[ssl.SSLContext]
    settings: ControlPlaneSettings


class Replay:
    """A source that ignores the nonce: evidence recorded once, served again."""

    def __init__(self) -> None:
        self._recorded = SimEvidenceSource(PLATFORM, MEASUREMENT).collect(
            bytes(64), nonce=bytes(32), spki=b"k"
        )

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        return self._recorded


async def _serve(tmp_path: Path, source: Any, *, chain_of: Any = None) -> AsyncIterator[Served]:
    now = datetime.now(UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, now)
    settings = ControlPlaneSettings(state_dir=tmp_path, trust_domain=TD)
    ctx = _api_tls()
    _load_server_cert([ctx], ca, settings, now)
    chain_file = tmp_path / "tls" / "server.pem"
    sa = SelfAttestation(
        source, chain_of or chain_file.read_bytes, lambda: ca.bundle_pem, rate=1000.0
    )
    app = web.Application()
    sa.route(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Served(f"https://127.0.0.1:{port}", ca, sa, [ctx], settings)
    finally:
        await runner.cleanup()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async for s in _serve(tmp_path, SimEvidenceSource(PLATFORM, MEASUREMENT)):
        yield s


async def _verify(url: str, **kw: Any) -> Any:
    args = {"verifiers": VERIFIERS, "policies": POLICY, "spiffe_id": CP_ID, **kw}
    return await asyncio.to_thread(verify_controlplane, url, **args)


async def _reason(url: str, **kw: Any) -> str:
    with pytest.raises(ControlPlaneAttestationError) as err:
        await _verify(url, **kw)
    return err.value.reason


async def test_an_attested_control_plane_verifies_and_names_its_mesh_ca(served: Served) -> None:
    verified = await _verify(served.url)
    assert verified.claims.tee is Tee.SIM
    assert verified.claims.measurements["measurement"] == MEASUREMENT_HEX
    assert verified.policy == "attestmesh-system/cp"
    assert verified.trust_bundle_pem == served.ca.bundle_pem
    assert served.self_attestation.served == 1
    # the serving certificate rotates: the evidence follows the key new handshakes use
    _load_server_cert(served.contexts, served.ca, served.settings, datetime.now(UTC))
    assert (await _verify(served.url)).trust_bundle_pem == served.ca.bundle_pem


async def test_a_control_plane_the_policy_does_not_admit_is_rejected(tmp_path: Path) -> None:
    async for s in _serve(tmp_path, SimEvidenceSource(PLATFORM, OTHER_MEASUREMENT)):
        assert await _reason(s.url) == "cp_rejected"
    other_platform = {Tee.SIM: SimVerifier([ec.generate_private_key(ec.SECP256R1()).public_key()])}
    async for s in _serve(tmp_path / "b", SimEvidenceSource(PLATFORM, MEASUREMENT)):
        assert await _reason(s.url, verifiers=other_platform) == "cp_evidence_invalid"
        assert await _reason(s.url, spiffe_id="spiffe://other/ns/x/sa/y") == "cp_chain_invalid"


async def test_replayed_evidence_is_not_bound_to_this_request(tmp_path: Path) -> None:
    async for s in _serve(tmp_path, Replay()):
        assert await _reason(s.url) == "cp_binding_mismatch"


async def test_evidence_for_another_key_than_the_tls_peer_is_refused(tmp_path: Path) -> None:
    """A relay that terminates TLS with its own certificate and passes the real control
    plane's answer through: the evidence is bound to a key the client did not talk to."""
    elsewhere = tmp_path / "elsewhere"
    now = datetime.now(UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, now)
    _load_server_cert([_api_tls()], ca, ControlPlaneSettings(state_dir=elsewhere, trust_domain=TD),
                      now)  # fmt: skip
    other_chain = (elsewhere / "tls" / "server.pem").read_bytes
    async for s in _serve(tmp_path, SimEvidenceSource(PLATFORM, MEASUREMENT), chain_of=other_chain):
        assert await _reason(s.url) == "cp_key_mismatch"


async def test_a_control_plane_without_evidence_and_bad_requests(served: Served) -> None:
    app = web.Application()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ctx = _api_tls()
    _load_server_cert([ctx], served.ca, served.settings, datetime.now(UTC))
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    try:
        url = f"https://127.0.0.1:{runner.addresses[0][1]}"
        assert await _reason(url) == "cp_not_attested"
    finally:
        await runner.cleanup()
    assert await _reason("http://127.0.0.1:1") == "cp_unreachable"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert await _reason(f"https://127.0.0.1:{closed}") == "cp_unreachable"
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    async with aiohttp.ClientSession() as session:
        for nonce in ("", "AAAA", "!" * 43, "A" * 200):
            async with session.get(
                f"{served.url}{cp_attest.PATH}", params={"nonce": nonce}, ssl=insecure
            ) as resp:
                assert resp.status == 400, nonce
    assert served.self_attestation.served == 0 and served.self_attestation.refused == 4


async def test_collection_is_rate_limited(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, now)
    settings = ControlPlaneSettings(state_dir=tmp_path, trust_domain=TD)
    _load_server_cert([_api_tls()], ca, settings, now)
    ticks = iter([100.0, 100.1, 100.6])
    sa = SelfAttestation(SimEvidenceSource(PLATFORM, MEASUREMENT),
                         (tmp_path / "tls" / "server.pem").read_bytes, lambda: ca.bundle_pem,
                         rate=2.0, clock=lambda: next(ticks))  # fmt: skip
    app = web.Application()
    sa.route(app)
    from aiohttp.test_utils import TestClient, TestServer

    nonce = base64.urlsafe_b64encode(bytes(32)).rstrip(b"=").decode()
    async with TestClient(TestServer(app)) as client:
        codes = [
            (await client.get(cp_attest.PATH, params={"nonce": nonce})).status for _ in range(3)
        ]
    assert codes == [200, 429, 200]


# -- real evidence formats through the client's parse and check --------------------------------


def _answer(tee: str, evidence: bytes, collateral: dict[str, bytes], ca: CertificateAuthority,
            chain: bytes) -> bytes:  # fmt: skip
    return json.dumps(
        {
            "tee": tee,
            "evidence": base64.b64encode(evidence).decode(),
            "collateral": {k: base64.b64encode(v).decode() for k, v in collateral.items()},
            "certificate_chain": chain.decode(),
            "trust_bundle": ca.bundle_pem.decode(),
        }
    ).encode()


def test_real_snp_and_tdx_evidence_parse_verify_and_are_not_bound(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, now)
    settings = ControlPlaneSettings(state_dir=tmp_path, trust_domain=TD)
    _load_server_cert([_api_tls()], ca, settings, now)
    chain = (tmp_path / "tls" / "server.pem").read_bytes()
    peer = x509.load_pem_x509_certificates(chain)[0].public_bytes(serialization.Encoding.DER)
    snp = parse_response(_answer("sev-snp", IDBLOCK.evidence(), IDBLOCK.collateral(), ca, chain))
    assert snp.tee == "sev-snp" and snp.chain[0].public_bytes(serialization.Encoding.DER) == peer
    with pytest.raises(ControlPlaneAttestationError) as err:
        check_attestation(
            snp, peer_der=peer, nonce=bytes(32), spiffe_id=CP_ID, now=IDBLOCK.pin,
            verifiers={Tee.SEV_SNP: SevSnpVerifier([MILAN, GENOA, MILAN_VLEK])}, policies=POLICY,
        )  # fmt: skip
    assert err.value.reason == "cp_binding_mismatch"  # authentic, but not bound to this request
    v4 = fx.vector("tdx/dcapqvl_v4")
    tdx = parse_response(_answer("tdx", v4.quote, dict(v4.collateral), ca, chain))
    with pytest.raises(ControlPlaneAttestationError) as err:
        check_attestation(
            tdx, peer_der=peer, nonce=bytes(32), spiffe_id=CP_ID, now=v4.pin,
            verifiers={Tee.TDX: TdxVerifier(fx.intel_root())}, policies=POLICY,
        )  # fmt: skip
    assert err.value.reason == "cp_binding_mismatch"


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"tee": "sim"}',
        json.dumps(
            {
                "tee": "quantum",
                "evidence": "",
                "collateral": {},
                "certificate_chain": "",
                "trust_bundle": "",
            }
        ).encode(),
        json.dumps(
            {
                "tee": "sim",
                "evidence": "@@",
                "collateral": {},
                "certificate_chain": "",
                "trust_bundle": "",
            }
        ).encode(),
        json.dumps(
            {
                "tee": "sim",
                "evidence": "",
                "collateral": {"x": 1},
                "certificate_chain": "",
                "trust_bundle": "",
            }
        ).encode(),
        json.dumps(
            {
                "tee": "sim",
                "evidence": "",
                "collateral": {},
                "certificate_chain": "x",
                "trust_bundle": "x",
            }
        ).encode(),
        b" " * (cp_attest.MAX_RESPONSE + 1),
    ],
)
def test_malformed_answers_are_refused(body: bytes) -> None:
    with pytest.raises(ControlPlaneAttestationError) as err:
        parse_response(body)
    assert err.value.reason == "cp_response_invalid"


# -- the CLI and the agent's gate -------------------------------------------------------------------


def _policy_file(tmp_path: Path, measurement: str = MEASUREMENT_HEX) -> Path:
    doc = policy_doc("cp", "attestmesh-system", service_accounts=["controlplane"],
                     refs={"sim": {"measurement": [measurement]}})  # fmt: skip
    path = tmp_path / "cp-policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _platform_pub(tmp_path: Path) -> Path:
    path = tmp_path / "platform.pub"
    path.write_bytes(
        PLATFORM.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


async def test_verify_controlplane_command(served: Served, tmp_path: Path) -> None:
    def run(*argv: str) -> tuple[int, str]:
        parser = argparse.ArgumentParser()
        cp_attest.add_parser(parser.add_subparsers())
        out = io.StringIO()
        return cp_attest.run(parser.parse_args(["verify-controlplane", *argv]), out), out.getvalue()

    pub, ca_out = _platform_pub(tmp_path), tmp_path / "mesh-ca.pem"
    common = ["--trust-domain", TD, "--sim-platform-key", str(pub)]
    code, out = await asyncio.to_thread(
        run, served.url, "--policy", str(_policy_file(tmp_path)), *common, "--ca-out", str(ca_out)
    )
    assert code == 0 and "runs in sim, admitted by attestmesh-system/cp" in out
    assert ca_out.read_bytes() == served.ca.bundle_pem
    bad = _policy_file(tmp_path, "00" * 48)
    code, out = await asyncio.to_thread(run, served.url, "--policy", str(bad), *common, "--json")
    assert code == 1 and json.loads(out)["reason"] == "cp_rejected"
    code, out = await asyncio.to_thread(run, served.url, "--policy", str(bad), "--json")
    assert code == 2 and json.loads(out)["reason"] == "cp_evidence_invalid"  # sim not accepted


async def test_the_gate_refuses_evidence_to_an_unverified_control_plane(served: Served) -> None:
    results: list[Any] = []

    def check() -> list[Any]:
        results.append(verify_controlplane(served.url, verifiers=VERIFIERS, policies=POLICY,
                                           spiffe_id=CP_ID))  # fmt: skip
        return results[-1:]

    source = SimEvidenceSource(PLATFORM, MEASUREMENT)
    gate = ControlPlaneGate(check, served.ca.bundle_pem)
    guarded = gate.guard(source)
    with pytest.raises(ControlPlaneAttestationError) as err:
        guarded.collect(bytes(64), nonce=bytes(32), spki=b"k")
    assert err.value.reason == "cp_not_verified" and "not checked yet" in err.value.detail
    assert await gate.refresh() and gate.verified()
    assert guarded.collect(bytes(64), nonce=bytes(32), spki=b"k").tee == "sim"
    # a gate whose --ca-bundle is another mesh's stays closed
    other = CertificateAuthority.load_or_create(Path(served.settings.state_dir) / "o", TD,
                                                datetime.now(UTC))  # fmt: skip
    wrong = ControlPlaneGate(check, other.bundle_pem)
    assert not await wrong.refresh()
    assert wrong.last_error is not None and wrong.last_error.reason == "cp_bundle_mismatch"
    # and it closes when the verification gets old
    ticks = [0.0]
    aging = ControlPlaneGate(check, served.ca.bundle_pem, max_age=60, clock=lambda: ticks[0])
    assert await aging.refresh()
    ticks[0] = 61.0
    assert not aging.verified()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_control_plane_process_serves_its_evidence_and_the_agent_gates_on_it(
    tmp_path: Path,
) -> None:
    """run_control_plane with --self-tee sim: the serve wiring, then the real agent with a
    gate: an admitted control plane gets the evidence, a stricter policy's gate keeps it."""
    state = tmp_path / "state"
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(policy_doc()))
    pub = _platform_pub(tmp_path)
    workloads = tmp_path / "workloads.yaml"
    reg = registration("web-1")
    workloads.write_text(yaml.safe_dump({"workloads": [{
        "name": reg.name, "namespace": reg.namespace, "serviceAccount": reg.service_account,
        "service": reg.service, "inbound": "127.0.0.1:15001", "appPort": 8080,
    }]}))  # fmt: skip
    settings = ControlPlaneSettings(
        state_dir=state, policy_file=policy, trust_domain=TD, api_port=_free_port(),
        xds_port=_free_port(), ops_port=_free_port(), sim_platform_keys=(pub,),
        allow_unauthenticated_registrations=True,
        registrations_file=workloads,
        self_attestation=SimEvidenceSource(PLATFORM, MEASUREMENT),
    )  # fmt: skip
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_control_plane(settings, stop, ready))
    try:
        running = await asyncio.wait_for(ready, 20)
        url = f"https://127.0.0.1:{settings.api_port}"
        verified = await _verify(url, spiffe_id=control_plane_spiffe_id(TD))
        assert verified.trust_bundle_pem == running.bundle_pem
        for admitted, policies in ((True, POLICY), (False, parse_policies([policy_doc(
                "cp", "attestmesh-system", service_accounts=["controlplane"],
                refs={"sim": {"measurement": ["00" * 48]}})]))):  # fmt: skip

            def check(p: Any = policies) -> list[Any]:
                return [verify_controlplane(url, verifiers=VERIFIERS, policies=p,
                                            spiffe_id=CP_ID)]  # fmt: skip

            gate = ControlPlaneGate(check, running.bundle_pem)
            assert await gate.refresh() is admitted
            sink = RecordingSink()
            agent = Agent(url=url, workload="web-1", source=gate.guard(
                SimEvidenceSource(PLATFORM, MEASUREMENT)), sink=sink,
                ssl_context=client_ssl_context(running.bundle_pem), token=lambda: None,
                timeout_s=5.0)  # fmt: skip
            async with aiohttp.ClientSession() as session:
                if admitted:
                    await agent.attest_once(session)
                    assert len(sink.updates) == 1
                else:
                    with pytest.raises(AgentError) as err:
                        await agent.attest_once(session)
                    assert "cp_not_verified" in str(err.value) and sink.updates == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def test_the_command_lines_wire_both_sides(tmp_path: Path) -> None:
    from attestmesh.cli import build_parser

    key = tmp_path / "platform.key"
    key.write_bytes(
        PLATFORM.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    parser = build_parser()
    cp_args = parser.parse_args(
        ["controlplane", "--state-dir", str(tmp_path), "--self-tee", "sim",
         "--self-sim-platform-key", str(key), "--self-sim-measurement", MEASUREMENT_HEX]
    )  # fmt: skip
    source = cp_attest.self_source_from_args(cp_args)
    assert isinstance(source, SimEvidenceSource) and source.measurement == MEASUREMENT
    plain = parser.parse_args(["controlplane", "--state-dir", str(tmp_path)])
    assert cp_attest.self_source_from_args(plain) is None
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(
        CertificateAuthority.load_or_create(tmp_path / "ca", TD, datetime.now(UTC)).bundle_pem
    )
    agent_args = parser.parse_args(
        ["agent", "--control-plane", "https://a:1,https://b:2", "--workload", "w",
         "--ca-bundle", str(bundle), "--sds-socket", str(tmp_path / "s"), "--tee", "sim",
         "--control-plane-policy", str(_policy_file(tmp_path)),
         "--control-plane-sim-platform-key", str(_platform_pub(tmp_path))]
    )  # fmt: skip
    gate = cp_attest.gate_from_args(agent_args, bundle.read_bytes())
    assert gate is not None and not gate.verified()
    no_gate = parser.parse_args(["agent", "--sds-socket", str(tmp_path / "s"), "--check"])
    assert cp_attest.gate_from_args(no_gate, b"") is None
