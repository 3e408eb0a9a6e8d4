"""Every hardware verifier is wired into the attestation path: real vectors verify at their
pinned time through the control plane and are then refused only because their report data
cannot bind our nonce and key (the vectors were produced for someone else's challenge)."""

from __future__ import annotations

import base64
import contextlib
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509

from attestmesh.controlplane import ControlPlane
from attestmesh.controlplane import http as api
from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority
from certs.collateral.amd_kds import KdsCollateralSource
from certs.collateral.cache import DiskCache, http_fetcher
from certs.collateral.roots import bundled_roots
from certs.evidence.claims import Tee
from certs.evidence.registry import build_verifiers
from certs.issuance import AttestRequest, EvidenceRejected
from certs.policy import parse_policies
from tests.unit.fixtures_core import csr_pem, new_key, policy_doc, registration
from tests.vectors import VECTORS, pin
from xds.state import MeshState
from xds.store import SqliteStore


@dataclass(frozen=True)
class Vector:
    tee: Tee
    evidence: bytes
    collateral: Mapping[str, bytes]
    at: datetime
    section: str
    ref: Mapping[str, object]


def vectors() -> list[Vector]:
    v = VECTORS
    return [
        Vector(Tee.NITRO, (v / "nitro/veracruz_eu-west-1_20221109.cbor").read_bytes(), {},
               pin("2022-11-09T23:00:00Z"), "nitro",
               {"pcr0": ["22f9e1c949208da55eb01b9b9fc88f87454f77ba133f0d82320b509621c92482152a99d0a12335b97178c02d6f977d01"]}),
        Vector(Tee.SEV_SNP, (v / "sev-snp/milan_v2_idblock_trustee/report.bin").read_bytes(),
               {"vcek": (v / "sev-snp/milan_v2_idblock_trustee/vcek.der").read_bytes()},
               pin("2024-07-01T00:00:00Z"), "sevSnp",
               {"measurement": ["a1f3930413247bb38cfc171579ea3c12d5fe4901f0c792f63fd75d98f1ef827c23500644e0e692e6be917f9050d3d38c"]}),
        Vector(Tee.TDX, (v / "tdx/dcapqvl_v4/quote.bin").read_bytes(),
               {"collateral_json": (v / "tdx/dcapqvl_v4/collateral.json").read_bytes()},
               pin("2025-06-20T00:00:00Z"), "tdx",
               {"mrtd": ["91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"]}),
        Vector(Tee.SGX, (v / "sgx-dcap/dcapqvl_sgx_v3/quote.bin").read_bytes(),
               {"collateral_json": (v / "sgx-dcap/dcapqvl_sgx_v3/collateral.json").read_bytes()},
               pin("2025-06-20T00:00:00Z"), "sgx",
               {"mrenclave": ["33d8736db756ed4997e04ba358d27833188f1932ff7b1d156904d3f560452fbb"]}),
        Vector(Tee.NVIDIA_GPU, (v / "nvidia/hopper_trustee/report.hex").read_bytes(),
               {"cert_chain": (v / "nvidia/hopper_trustee/cert_chain.pem").read_bytes()},
               pin("2026-01-01T00:00:00Z"), "nvidiaGpu", {"measurements": {"2": ["00"]}}),
    ]  # fmt: skip


class Recorder:
    def publish(self, *args: object) -> None:
        pass

    def on_events(self, *args: object) -> None:
        pass


def control_plane(tmp: Path, vec: Vector, **kwargs: object) -> ControlPlane:
    doc = policy_doc(tees=[vec.tee.value], refs={vec.section: dict(vec.ref)})
    cp = ControlPlane(
        state=MeshState("mesh.example"),
        store=SqliteStore(tmp / "s.sqlite3"),
        ca=CertificateAuthority.load_or_create(tmp / "ca", "mesh.example", vec.at),
        verifiers=build_verifiers(bundled_roots()),
        policies=parse_policies([doc]),
        mesh_policies=(),
        metrics=Metrics(),
        publisher=Recorder(),
        clock=lambda: vec.at,
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
        **kwargs,  # type: ignore[arg-type]
    )
    cp.register([registration()])
    return cp


@pytest.mark.parametrize("vec", vectors(), ids=lambda v: v.tee.value)
async def test_real_evidence_verifies_then_fails_only_the_binding(
    tmp_path: Path, vec: Vector
) -> None:
    cp = control_plane(tmp_path, vec)
    nonce, _ = cp.challenge()
    req = AttestRequest("web-1", vec.tee.value, vec.evidence, csr_pem(new_key()), nonce,
                        vec.collateral)  # fmt: skip
    with pytest.raises(EvidenceRejected) as exc:
        await cp.attest(req, None)
    assert exc.value.reason == "binding_mismatch"


@pytest.mark.parametrize("vec", vectors()[:4], ids=lambda v: v.tee.value)
async def test_tampered_real_evidence_is_refused_before_the_binding(
    tmp_path: Path, vec: Vector
) -> None:
    cp = control_plane(tmp_path, vec)
    nonce, _ = cp.challenge()
    bad = bytearray(vec.evidence)
    bad[len(bad) // 3] ^= 0x01
    req = AttestRequest("web-1", vec.tee.value, bytes(bad), csr_pem(new_key()), nonce,
                        vec.collateral)  # fmt: skip
    with pytest.raises(EvidenceRejected) as exc:
        await cp.attest(req, None)
    assert exc.value.reason not in ("binding_mismatch", "tee_not_supported")


@contextlib.asynccontextmanager
async def kds_server(vcek: bytes) -> AsyncIterator[TestServer]:
    async def handler(request: web.Request) -> web.Response:
        if request.path.startswith("/vcek/v1/Milan/") and not request.path.endswith("cert_chain"):
            return web.Response(body=vcek)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    async with TestServer(app) as server:
        yield server


async def test_snp_without_vcek_fetches_it_from_kds_through_the_http_api(tmp_path: Path) -> None:
    """Over the real HTTP API: no VCEK supplied; the control plane fetches it from (a local)
    AMD KDS, verifies the report, and refuses it for the binding only."""
    vec = vectors()[1]
    async with kds_server(vec.collateral["vcek"]) as kds, aiohttp.ClientSession() as session:
        source = KdsCollateralSource(
            str(kds.make_url("")), DiskCache(tmp_path / "kds"), http_fetcher(session)
        )
        cp = control_plane(tmp_path, vec, collateral_sources={Tee.SEV_SNP: source})
        async with TestClient(TestServer(api.build_app(cp, Metrics()))) as client:
            nonce = base64.b64decode((await (await client.post("/v1/challenge")).json())["nonce"])
            body = {
                "workload": "web-1", "tee": "sev-snp",
                "evidence": base64.b64encode(vec.evidence).decode(),
                "csr": csr_pem(new_key()).decode(), "nonce": base64.b64encode(nonce).decode(),
            }  # fmt: skip
            resp = await client.post("/v1/attest", json=body)
            assert resp.status == 403
            assert (await resp.json())["error"] == "binding_mismatch"
