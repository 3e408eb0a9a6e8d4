"""Composite CPU + GPU attestation end to end: the real agent (GpuAttachedSource over a faked
CVM report and two faked H100s at the device seam, test-signed) against the real attestation
API over HTTPS on loopback; the control plane's verifiers are the production ones wrapped by
``attach_gpus``, its policy ``requires: [sev-snp, nvidia-gpu]``. The issued leaf carries both
claim sets, and a mesh rule on a GPU measurement matches the workload on record."""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane import ControlPlane
from attestmesh.controlplane.http import build_app
from attestmesh.metrics import Metrics
from certs.ca import CLAIMS_OID, CertificateAuthority, decode_claims_extension
from certs.ear import verify_certificate_ear
from certs.evidence.claims import Tee
from certs.evidence.composite import attach_gpus
from certs.evidence.nvidia_gpu import NvidiaGpuVerifier
from certs.evidence.sev_snp import SevSnpVerifier, parse_amd_chain
from certs.policy import parse_policies
from sidecar.agent import Agent, AgentError, Evidence, client_ssl_context
from sidecar.gpu import GpuAttachedSource, chain_pem, nvidia_sdk_gpus
from tests.component.test_agent import RecordingSink, _server_tls
from tests.unit.evidence import test_nvidia as nv
from tests.unit.evidence.test_sev_snp import CHIP, IDBLOCK, SYN_TCB, TCB_RAW, _Amd, _sign
from tests.unit.fixtures_core import (
    TRUST_DOMAIN,
    Clock,
    RecordingPublisher,
    policy_doc,
    registration,
)
from xds.meshpolicy import parse_mesh_policies
from xds.state import Status
from xds.store import SqliteStore

FWID = bytes(range(48))
GPU_VALUE = bytes(range(48)).hex()


class FakeCvm:
    """The CVM's evidence source: a synthetic SNP report over the agent's report data."""

    def __init__(self, amd: _Amd) -> None:
        self._key = ec.generate_private_key(ec.SECP384R1())
        self.vcek = amd.vcek(self._key, SYN_TCB, CHIP, "Milan-B0")

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        template = bytearray(IDBLOCK.evidence())
        template[0x50:0x90] = report_data
        report = _sign(bytes(template), self._key, reported_tcb=TCB_RAW, chip_id=CHIP)
        return Evidence("sev-snp", report, {"vcek": self.vcek})


@dataclass
class FakeH100:
    """NVIDIA's device interface, faked: signs SPDM reports with a test device key."""

    key: ec.EllipticCurvePrivateKey
    bundle: bytes
    asked: list[bytes] = field(default_factory=list)
    replay: bytes | None = None

    def attestation_report(self, nonce: bytes) -> bytes:
        self.asked.append(nonce)
        return nv.build_report(self.key, FWID, self.replay or nonce)

    def certificate_chain(self) -> bytes:
        return self.bundle


@dataclass
class Env:
    cp: ControlPlane
    url: str
    bundle: bytes
    clock: Clock
    cvm: FakeCvm
    gpus: list[FakeH100]


@pytest.fixture
async def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Env]:
    now = datetime.now(UTC).replace(microsecond=0)  # TLS checks the real clock
    monkeypatch.setattr(nv, "T0", now)  # the synthetic GPU chain is valid around T0
    amd = _Amd()
    bundle, gpu_key = nv.make_leaf(FWID)
    gpu_root = bundle[bundle.index(b"-----BEGIN", 10) :]
    cvm = FakeCvm(amd)
    clock = Clock(now)
    store = SqliteStore(tmp_path / "state.db")
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, now)
    verifiers = attach_gpus(
        {
            Tee.SEV_SNP: SevSnpVerifier([parse_amd_chain(amd.chain_pem())]),
            Tee.NVIDIA_GPU: NvidiaGpuVerifier(gpu_root),
        }
    )
    probe = SevSnpVerifier([parse_amd_chain(amd.chain_pem())])
    launch = probe.verify(
        cvm.collect(bytes(64), nonce=b"", spki=b"").evidence,
        now=now,
        collateral={"vcek": cvm.vcek},
    ).measurements["measurement"]
    refs = {"sevSnp": {"measurement": [launch]}, "nvidiaGpu": {"measurements": {"1": [GPU_VALUE]}}}
    policy = policy_doc(
        "cvm-gpu", tees=["sev-snp", "nvidia-gpu"], refs=refs, requires=["sev-snp", "nvidia-gpu"]
    )
    cp = ControlPlane(
        state=store.load(TRUST_DOMAIN), store=store, ca=ca, verifiers=verifiers,
        policies=parse_policies([policy]), mesh_policies=(), metrics=Metrics(),
        publisher=RecordingPublisher(), clock=clock, serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
    )  # fmt: skip
    cp.register([registration("web-1")])
    runner = web.AppRunner(build_app(cp, Metrics()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=_server_tls(ca, tmp_path, now))
    await site.start()
    port = runner.addresses[0][1]
    gpus = [FakeH100(gpu_key, bundle), FakeH100(gpu_key, bundle)]
    try:
        yield Env(cp, f"https://127.0.0.1:{port}/", ca.bundle_pem, clock, cvm, gpus)
    finally:
        await runner.cleanup()
        store.close()


def _agent(env: Env, source: object) -> tuple[Agent, RecordingSink]:
    sink = RecordingSink()
    agent = Agent(
        url=env.url, workload="web-1", source=source, sink=sink,  # type: ignore[arg-type]
        ssl_context=client_ssl_context(env.bundle), token=lambda: None, clock=env.clock,
        timeout_s=5.0,
    )  # fmt: skip
    return agent, sink


async def test_the_agent_attests_cpu_and_gpus_in_one_attestation(env: Env) -> None:
    agent, sink = _agent(env, GpuAttachedSource(env.cvm, env.gpus))
    async with aiohttp.ClientSession() as session:
        await agent.attest_once(session)
    assert env.cp.status_of("web-1") is Status.ATTESTED
    # each GPU was asked for its own nonce
    assert len({g.asked[0] for g in env.gpus}) == 2
    leaf, intermediate = x509.load_pem_x509_certificates(sink.updates[0][0])
    claims = decode_claims_extension(
        leaf.extensions.get_extension_for_oid(CLAIMS_OID).value.value  # type: ignore[attr-defined]
    )
    measurements = claims["measurements"]
    assert isinstance(measurements, dict)
    assert measurements["gpu0.measurement_1"] == measurements["gpu1.measurement_1"] == GPU_VALUE
    assert "measurement" in measurements
    ear = verify_certificate_ear(leaf, intermediate)
    assert set(ear.submods) == {"sev-snp", "nvidia-gpu.0", "nvidia-gpu.1"}
    # a mesh rule conditioned on a GPU measurement holds for this workload
    (rule_doc,) = parse_mesh_policies(
        [
            {
                "apiVersion": "attestmesh.dev/v1alpha1",
                "kind": "MeshPolicy",
                "metadata": {"name": "gpu-callers", "namespace": "default"},
                "spec": {
                    "destination": {"serviceAccount": "web"},
                    "rules": [
                        {
                            "from": [{"serviceAccount": "web"}],
                            "whenClaims": {"measurements": {"gpu0.measurement_1": [GPU_VALUE]}},
                        }
                    ],
                },
            }
        ]
    )
    condition = rule_doc.rules[0].when_claims
    assert condition is not None and condition.matches(env.cp.state.get("web-1"))


async def test_without_the_gpus_the_policy_refuses(env: Env) -> None:
    agent, sink = _agent(env, env.cvm)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(AgentError) as err:
            await agent.attest_once(session)
    assert "tee_required" in str(err.value)
    assert env.cp.status_of("web-1") is not Status.ATTESTED and sink.updates == []


async def test_a_replayed_gpu_report_is_refused(env: Env) -> None:
    env.gpus[1].replay = bytes(32)  # a report some earlier exchange produced
    agent, sink = _agent(env, GpuAttachedSource(env.cvm, env.gpus))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(AgentError) as err:
            await agent.attest_once(session)
    assert "gpu_binding_mismatch" in str(err.value)
    assert sink.updates == []


def test_a_gpu_source_needs_gpus_and_a_cvm(env: Env) -> None:
    from certs.errors import AttestmeshError

    with pytest.raises(AttestmeshError):
        GpuAttachedSource(env.cvm, [])

    class Enclave:
        def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
            return Evidence("sgx", b"quote")

    with pytest.raises(AttestmeshError) as err:
        GpuAttachedSource(Enclave(), env.gpus).collect(bytes(64), nonce=bytes(32), spki=b"k")
    assert err.value.reason == "tee_unsupported"


# -- NVIDIA's attestation SDK as the device interface, faked at its evidence call ---------------


class FakeSdk:
    """``generate_evidence(nonce hex)`` as NVIDIA's SDK answers: one entry per GPU, the report
    as hex, the chain base64 (here DER certificates back to back)."""

    def __init__(self, gpus: list[FakeH100]) -> None:
        self.gpus = gpus
        self.calls: list[str] = []

    def __call__(self, nonce_hex: str) -> list[dict[str, str]]:
        self.calls.append(nonce_hex)
        out = []
        for g in self.gpus:
            ders = b"".join(
                c.public_bytes(serialization.Encoding.DER)
                for c in x509.load_pem_x509_certificates(g.bundle)
            )
            out.append(
                {
                    "attestationReportHexStr": g.attestation_report(bytes.fromhex(nonce_hex)).hex(),
                    "certChainBase64Encoded": base64.b64encode(ders).decode(),
                }
            )
        return out


async def test_the_agent_attests_through_nvidias_sdk(env: Env) -> None:
    sdk = FakeSdk(env.gpus)
    agent, sink = _agent(env, GpuAttachedSource(env.cvm, nvidia_sdk_gpus(2, sdk)))
    async with aiohttp.ClientSession() as session:
        await agent.attest_once(session)
    assert env.cp.status_of("web-1") is Status.ATTESTED
    assert len(sdk.calls) == 2 and sdk.calls[0] != sdk.calls[1]  # a nonce per GPU
    leaf = x509.load_pem_x509_certificates(sink.updates[0][0])[0]
    doc = decode_claims_extension(leaf.extensions.get_extension_for_oid(CLAIMS_OID).value.value)  # type: ignore[attr-defined]
    assert doc["measurements"]["gpu1.measurement_1"] == GPU_VALUE  # type: ignore[index]


def test_sdk_failures_are_clear_errors(env: Env) -> None:
    from certs.errors import AttestmeshError

    def boom(nonce_hex: str) -> list[dict[str, str]]:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    for generate, problem in (
        (boom, "NVML_ERROR_NOT_SUPPORTED"),
        (lambda n: [], "reports 0 GPUs"),
        (lambda n: [{"attestationReportHexStr": 1}], "no report/chain"),
        (lambda n: [{"attestationReportHexStr": "zz", "certChainBase64Encoded": ""}], "unreadable"),
    ):
        (gpu,) = nvidia_sdk_gpus(1, generate)  # type: ignore[arg-type]
        with pytest.raises(AttestmeshError) as err:
            gpu.attestation_report(bytes(32))
        assert err.value.reason == "gpu_unavailable" and problem in err.value.detail
    with pytest.raises(AttestmeshError) as err:
        nvidia_sdk_gpus(1, FakeSdk(env.gpus))[0].certificate_chain()
    assert err.value.reason == "gpu_unavailable"
    # PEM passes through, DER back to back becomes PEM, anything else is refused
    pem = env.gpus[0].bundle
    assert chain_pem(pem) == pem
    ders = b"".join(
        c.public_bytes(serialization.Encoding.DER) for c in x509.load_pem_x509_certificates(pem)
    )
    assert x509.load_pem_x509_certificates(chain_pem(ders)) == x509.load_pem_x509_certificates(pem)
    for bad in (b"", b"\x30\x82\xff\xff", b"junk"):
        with pytest.raises(ValueError):
            chain_pem(bad)


def test_agent_gpus_flag_needs_the_sdk(tmp_path: Path) -> None:
    from attestmesh.agent_cmd import run_agent
    from attestmesh.cli import build_parser
    from certs.errors import AttestmeshError

    key = tmp_path / "k.pem"
    key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    args = build_parser().parse_args(
        ["agent", "--control-plane", "https://127.0.0.1:1", "--workload", "w",
         "--ca-bundle", str(key), "--sds-socket", str(tmp_path / "s"), "--tee", "sim",
         "--sim-platform-key", str(key), "--sim-measurement", "00" * 48, "--gpus", "1"]
    )  # fmt: skip
    assert args.gpus == 1
    with pytest.raises(AttestmeshError) as err:
        run_agent(args)
    assert err.value.reason == "usage" and "nv-attestation-sdk" in err.value.detail
