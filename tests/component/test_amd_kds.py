"""AMD KDS fetcher against a real loopback HTTP server serving the vectors' certificates."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from certs.collateral.amd_kds import KdsCollateralSource, cert_chain_url, vcek_url
from certs.collateral.cache import DiskCache, http_fetcher
from certs.errors import CollateralError
from certs.evidence.sev_snp import Product, SevSnpVerifier, SigningKey, decode_tcb, parse_report
from tests.vectors import VECTORS, pin

SNP = VECTORS / "sev-snp"
MILAN_CHAIN = (SNP / "amd" / "ask_ark_milan.pem").read_bytes()
GENOA_CHAIN = (SNP / "amd" / "ask_ark_genoa.pem").read_bytes()
VLEK_CHAIN = (SNP / "amd" / "asvk_ark_milan_vlek.pem").read_bytes()

GOSEV_REPORT = (SNP / "milan_v2_gosevguest" / "report.bin").read_bytes()
GOSEV_VCEK = (SNP / "milan_v2_gosevguest" / "vcek.der").read_bytes()
GOSEV_PIN = pin("2023-01-01T00:00:00Z")
GOSEV_NOT_AFTER = pin("2029-09-24T00:55:28Z")
AZURE_REPORT = (SNP / "genoa_v3_azure_trustee" / "report.bin").read_bytes()
AZURE_PIN = pin("2026-02-01T00:00:00Z")
VLEK_REPORT = (SNP / "milan_v3_vlek_aws_trustee" / "report.bin").read_bytes()
VLEK_CERT = (SNP / "milan_v3_vlek_aws_trustee" / "vlek.der").read_bytes()
VLEK_PIN = pin("2025-05-28T00:00:00Z")


def _azure_vcek_der() -> bytes:
    pem = (SNP / "genoa_v3_azure_trustee" / "vcek.pem").read_text()
    body = "".join(line for line in pem.splitlines() if line and not line.startswith("-----"))
    return base64.b64decode(body)


AZURE_VCEK = _azure_vcek_der()


@dataclass
class FakeKds:
    """Serves what AMD KDS serves, for the vectors' chips; records every request."""

    requests: list[str] = field(default_factory=list)
    down: bool = False
    vceks: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for report, vcek, product in (
            (GOSEV_REPORT, GOSEV_VCEK, Product.MILAN),
            (AZURE_REPORT, AZURE_VCEK, Product.GENOA),
        ):
            parsed = parse_report(report)
            url = vcek_url("", product, parsed.chip_id, decode_tcb(parsed.reported_tcb, product))
            self.vceks[url] = vcek

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/vcek/v1/{product}/cert_chain", self.vcek_chain)
        app.router.add_get("/vlek/v1/{product}/cert_chain", self.vlek_chain)
        app.router.add_get("/vcek/v1/{product}/{hwid}", self.vcek)
        return app

    def _record(self, request: web.Request) -> None:
        self.requests.append(request.path_qs)
        if self.down:
            raise web.HTTPServiceUnavailable()

    async def vcek_chain(self, request: web.Request) -> web.Response:
        self._record(request)
        chains = {"Milan": MILAN_CHAIN, "Genoa": GENOA_CHAIN}
        if request.match_info["product"] not in chains:
            raise web.HTTPNotFound()
        return web.Response(body=chains[request.match_info["product"]])

    async def vlek_chain(self, request: web.Request) -> web.Response:
        self._record(request)
        if request.match_info["product"] != "Milan":
            raise web.HTTPNotFound()
        return web.Response(body=VLEK_CHAIN)

    async def vcek(self, request: web.Request) -> web.Response:
        self._record(request)
        body = self.vceks.get(request.path_qs)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(body=body, content_type="application/octet-stream")


@dataclass
class Env:
    kds: FakeKds
    server: TestServer
    session: aiohttp.ClientSession
    cache_dir: Path

    @property
    def base(self) -> str:
        return str(self.server.make_url("/")).rstrip("/")

    def source(self, **kw: object) -> KdsCollateralSource:
        return KdsCollateralSource(
            self.base,
            DiskCache(self.cache_dir),
            http_fetcher(self.session, timeout_s=5.0),
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    kds = FakeKds()
    server = TestServer(kds.app())
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        try:
            yield Env(kds, server, session, tmp_path / "cache")
        finally:
            await server.close()


VERIFIER = SevSnpVerifier([MILAN_CHAIN, GENOA_CHAIN, VLEK_CHAIN])


def test_url_forms() -> None:
    report = parse_report(GOSEV_REPORT)
    url = vcek_url(
        "https://kdsintf.amd.com/",
        Product.MILAN,
        report.chip_id,
        decode_tcb(report.reported_tcb, Product.MILAN),
    )
    assert url == (
        "https://kdsintf.amd.com/vcek/v1/Milan/"
        + report.chip_id.hex()
        + "?blSPL=02&teeSPL=00&snpSPL=05&ucodeSPL=68"
    )
    turin = vcek_url(
        "https://k",
        Product.TURIN,
        bytes(range(64)),
        decode_tcb(int.from_bytes(bytes([1, 2, 3, 4, 0, 0, 0, 200]), "little"), Product.TURIN),
    )
    assert turin == (
        "https://k/vcek/v1/Turin/0001020304050607?fmcSPL=01&blSPL=02&teeSPL=03&snpSPL=04"
        "&ucodeSPL=200"
    )
    assert cert_chain_url("https://k", Product.GENOA, SigningKey.VCEK) == (
        "https://k/vcek/v1/Genoa/cert_chain"
    )
    assert cert_chain_url("https://k", Product.MILAN, SigningKey.VLEK) == (
        "https://k/vlek/v1/Milan/cert_chain"
    )


async def test_fetch_then_verify(env: Env) -> None:
    collateral = await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert collateral == {"vcek": GOSEV_VCEK, "cert_chain": MILAN_CHAIN}
    assert [p.split("?")[0].rsplit("/", 1)[-1][:8] for p in env.kds.requests] == [
        parse_report(GOSEV_REPORT).chip_id.hex()[:8],
        "cert_cha",
    ]
    claims = VERIFIER.verify(GOSEV_REPORT, now=GOSEV_PIN, collateral=collateral)
    assert claims.tcb["snp"] == 5


async def test_v3_report_asks_for_its_own_product(env: Env) -> None:
    collateral = await env.source().collateral_for(AZURE_REPORT, {}, AZURE_PIN)
    assert collateral["vcek"] == AZURE_VCEK
    assert collateral["cert_chain"] == GENOA_CHAIN
    assert all("/Genoa/" in p for p in env.kds.requests)
    assert len(env.kds.requests) == 2
    VERIFIER.verify(AZURE_REPORT, now=AZURE_PIN, collateral=collateral)


async def test_v2_report_falls_back_through_products(env: Env) -> None:
    source = env.source(fallback_products=(Product.GENOA, Product.MILAN))
    collateral = await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert collateral["vcek"] == GOSEV_VCEK
    assert [p.split("/")[3] for p in env.kds.requests] == ["Genoa", "Milan", "Milan"]


async def test_cache_hit_makes_no_second_request(env: Env) -> None:
    first = await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    count = len(env.kds.requests)
    # A new source over the same directory: the cache is on disk, not in the object.
    second = await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN + timedelta(days=30))
    assert second == first
    assert len(env.kds.requests) == count == 2


async def test_expired_entry_is_refetched(env: Env) -> None:
    source = env.source()
    await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert len(env.kds.requests) == 2
    later = GOSEV_NOT_AFTER + timedelta(seconds=1)
    collateral = await source.collateral_for(GOSEV_REPORT, {}, later)
    assert collateral["vcek"] == GOSEV_VCEK
    # Only the VCEK expired (notAfter 2029); the chain is good to 2045.
    assert len(env.kds.requests) == 3
    assert "/cert_chain" not in env.kds.requests[-1]


async def test_max_age_caps_expiry(env: Env) -> None:
    source = env.source(max_age=timedelta(hours=1))
    await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN + timedelta(minutes=59))
    assert len(env.kds.requests) == 2
    await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN + timedelta(hours=2))
    assert len(env.kds.requests) == 4


async def test_vendor_down_serves_stale_with_a_warning(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    source = env.source()
    fresh = await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    env.kds.down = True
    later = GOSEV_NOT_AFTER + timedelta(days=1)
    with caplog.at_level(logging.WARNING, logger="certs.collateral.cache"):
        stale = await source.collateral_for(GOSEV_REPORT, {}, later)
    assert stale == fresh
    assert any("serving stale collateral" in r.getMessage() for r in caplog.records)


async def test_vendor_unreachable_serves_stale(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    source = env.source()
    fresh = await source.collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    await env.server.close()
    with caplog.at_level(logging.WARNING):
        stale = await source.collateral_for(GOSEV_REPORT, {}, GOSEV_NOT_AFTER + timedelta(days=1))
    assert stale == fresh
    assert any(r.levelno == logging.WARNING for r in caplog.records)


async def test_vendor_down_with_empty_cache_is_collateral_error(env: Env) -> None:
    env.kds.down = True
    with pytest.raises(CollateralError) as info:
        await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert info.value.reason == "collateral_http_status"
    source = env.source()
    await env.server.close()
    with pytest.raises(CollateralError) as info:
        await source.collateral_for(AZURE_REPORT, {}, AZURE_PIN)
    assert info.value.reason == "collateral_unreachable"


async def test_unknown_chip_is_collateral_error(env: Env) -> None:
    forged = bytearray(GOSEV_REPORT)
    forged[0x1A0] ^= 0xFF
    with pytest.raises(CollateralError) as info:
        await env.source().collateral_for(bytes(forged), {}, GOSEV_PIN)
    assert info.value.reason == "collateral_http_status"


async def test_supplied_vcek_is_kept_and_only_chain_fetched(env: Env) -> None:
    collateral = await env.source().collateral_for(GOSEV_REPORT, {"vcek": GOSEV_VCEK}, GOSEV_PIN)
    assert collateral == {"vcek": GOSEV_VCEK, "cert_chain": MILAN_CHAIN}
    assert env.kds.requests == ["/vcek/v1/Milan/cert_chain"]  # product from productName


async def test_chain_failure_is_not_fatal(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.kds.down = True
    with caplog.at_level(logging.WARNING):
        collateral = await env.source().collateral_for(
            GOSEV_REPORT, {"vcek": GOSEV_VCEK}, GOSEV_PIN
        )
    assert collateral == {"vcek": GOSEV_VCEK}
    assert any("pinned" in r.getMessage() for r in caplog.records)
    VERIFIER.verify(GOSEV_REPORT, now=GOSEV_PIN, collateral=collateral)


async def test_vlek_must_be_supplied(env: Env) -> None:
    with pytest.raises(CollateralError) as info:
        await env.source().collateral_for(VLEK_REPORT, {}, VLEK_PIN)
    assert info.value.reason == "collateral_missing"
    assert env.kds.requests == []
    collateral = await env.source().collateral_for(VLEK_REPORT, {"vlek": VLEK_CERT}, VLEK_PIN)
    assert collateral == {"vlek": VLEK_CERT, "cert_chain": VLEK_CHAIN}
    assert env.kds.requests == ["/vlek/v1/Milan/cert_chain"]
    VERIFIER.verify(VLEK_REPORT, now=VLEK_PIN, collateral=collateral)


async def test_garbage_from_vendor_is_not_cached(env: Env) -> None:
    url = next(iter(env.kds.vceks))
    env.kds.vceks[url] = b"<html>maintenance</html>"
    with pytest.raises(CollateralError) as info:
        await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert info.value.reason == "collateral_invalid"
    env.kds.vceks[url] = GOSEV_VCEK
    collateral = await env.source().collateral_for(GOSEV_REPORT, {}, GOSEV_PIN)
    assert collateral["vcek"] == GOSEV_VCEK
