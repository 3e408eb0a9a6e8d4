"""Intel PCS v4 client against a local aiohttp server that serves real PCS responses.

The go-tdx-guest SPR vector carries raw PCS bodies and the issuer chains from the mocked
response headers; the server serves them at the PCS v4 paths with URL-encoded chain headers.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from certs.collateral.cache import DiskCache
from certs.collateral.intel_pcs import (
    PcsCollateralSource,
    PcsResponse,
    decode_blob,
    encode_blob,
    http_fetcher_with_headers,
    quote_facts,
)
from certs.errors import CollateralError, EvidenceVerificationError
from certs.evidence.tdx import TdxVerifier
from tests.vectors import VECTORS, pin

SPR = VECTORS / "tdx" / "gotdxguest_v4_spr"
QUOTE = (SPR / "quote.bin").read_bytes()
PIN = pin("2023-07-01T01:00:00Z")
ROOT = (VECTORS / "tdx" / "Intel_SGX_RootCA.der").read_bytes()


def _header(name: str) -> str:
    return urllib.parse.quote((SPR / name).read_text())


@dataclass
class FakePcs:
    hits: Counter[str] = field(default_factory=Counter)
    down: bool = False

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/tdx/certification/v4/tcb", self.tcb)
        app.router.add_get("/tdx/certification/v4/qe/identity", self.qe)
        app.router.add_get("/sgx/certification/v4/pckcrl", self.pckcrl)
        app.router.add_get("/IntelSGXRootCA.der", self.rootcrl)
        return app

    def _gate(self, name: str) -> None:
        self.hits[name] += 1
        if self.down:
            raise web.HTTPServiceUnavailable()

    async def tcb(self, request: web.Request) -> web.Response:
        self._gate("tcb")
        if request.query.get("fmspc", "").lower() != "50806f000000":
            raise web.HTTPNotFound()
        return web.Response(
            body=(SPR / "tcb_info_response.json").read_bytes(),
            headers={"TCB-Info-Issuer-Chain": _header("tcb_info_issuer_chain.pem")},
        )

    async def qe(self, request: web.Request) -> web.Response:
        self._gate("qe")
        return web.Response(
            body=(SPR / "qe_identity_response.json").read_bytes(),
            headers={"SGX-Enclave-Identity-Issuer-Chain": _header("qe_identity_issuer_chain.pem")},
        )

    async def pckcrl(self, request: web.Request) -> web.Response:
        self._gate("pckcrl")
        if request.query.get("ca") != "platform" or request.query.get("encoding") != "der":
            raise web.HTTPBadRequest()
        return web.Response(
            body=(SPR / "pck_crl_platform.der").read_bytes(),
            headers={"SGX-PCK-CRL-Issuer-Chain": _header("pck_crl_issuer_chain.pem")},
        )

    async def rootcrl(self, request: web.Request) -> web.Response:
        self._gate("root")
        return web.Response(body=(SPR / "root_ca_crl.der").read_bytes())


@dataclass
class Env:
    pcs: FakePcs
    source: PcsCollateralSource
    cache: DiskCache


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    pcs = FakePcs()
    runner = web.AppRunner(pcs.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}"
    cache = DiskCache(tmp_path / "cache")
    async with aiohttp.ClientSession() as session:
        source = PcsCollateralSource(
            base,
            cache,
            http_fetcher_with_headers(session, timeout_s=5.0),
            root_ca_crl_url=f"{base}/IntelSGXRootCA.der",
        )
        try:
            yield Env(pcs, source, cache)
        finally:
            await runner.cleanup()


def test_quote_facts() -> None:
    facts = quote_facts(QUOTE)
    assert (facts.tee, facts.fmspc, facts.ca) == ("tdx", "50806F000000", "platform")


def test_blob_round_trip() -> None:
    resp = PcsResponse(body=b"\x00\x01body", headers={"tcb-info-issuer-chain": "x%20y"})
    assert decode_blob(encode_blob(resp)) == resp
    with pytest.raises(CollateralError):
        decode_blob(b"not json")


async def test_fetch_then_verify(env: Env) -> None:
    coll = await env.source.collateral_for(QUOTE, {}, PIN)
    assert set(coll) == {
        "tcb_info",
        "tcb_info_issuer_chain",
        "qe_identity",
        "qe_identity_issuer_chain",
        "pck_crl",
        "pck_crl_issuer_chain",
        "root_ca_crl",
    }
    assert coll["tcb_info_issuer_chain"] == (SPR / "tcb_info_issuer_chain.pem").read_bytes()
    # The fetched collateral is complete and authentic: verification reaches TCB evaluation.
    with pytest.raises(EvidenceVerificationError) as err:
        TdxVerifier(ROOT).verify(QUOTE, now=PIN, collateral=coll)
    assert err.value.reason == "tcb_level_not_found"


async def test_cache_hit_does_not_refetch(env: Env) -> None:
    first = await env.source.collateral_for(QUOTE, {}, PIN)
    second = await env.source.collateral_for(QUOTE, {}, PIN + timedelta(days=1))
    assert first == second
    assert env.pcs.hits == Counter({"tcb": 1, "qe": 1, "pckcrl": 1, "root": 1})


async def test_supplied_collateral_wins(env: Env) -> None:
    coll = await env.source.collateral_for(QUOTE, {"root_ca_crl": b"mine"}, PIN)
    assert coll["root_ca_crl"] == b"mine"
    assert env.pcs.hits["root"] == 0
    full = await env.source.collateral_for(QUOTE, {"collateral_json": b"{}"}, PIN)
    assert full == {"collateral_json": b"{}"}


async def test_expired_entries_are_refetched(env: Env) -> None:
    await env.source.collateral_for(QUOTE, {}, PIN)
    # QE identity and PCK CRL expire 2023-07-08; TCB info 2023-07-18; root CRL 2024-04-02.
    await env.source.collateral_for(QUOTE, {}, pin("2023-07-10T00:00:00Z"))
    assert env.pcs.hits == Counter({"tcb": 1, "qe": 2, "pckcrl": 2, "root": 1})


async def test_vendor_down_serves_stale_with_warning(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = await env.source.collateral_for(QUOTE, {}, PIN)
    env.pcs.down = True
    with caplog.at_level(logging.WARNING):
        stale = await env.source.collateral_for(QUOTE, {}, pin("2023-08-01T00:00:00Z"))
    assert stale == fresh
    assert any("serving stale collateral" in r.getMessage() for r in caplog.records)


async def test_vendor_down_with_empty_cache_fails(env: Env) -> None:
    env.pcs.down = True
    with pytest.raises(CollateralError) as err:
        await env.source.collateral_for(QUOTE, {}, PIN)
    assert err.value.reason == "collateral_http_status"


async def test_unreachable_vendor(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        source = PcsCollateralSource(
            "http://127.0.0.1:9",
            DiskCache(tmp_path),
            http_fetcher_with_headers(session, timeout_s=2.0),
            root_ca_crl_url="http://127.0.0.1:9/root.der",
        )
        with pytest.raises(CollateralError) as err:
            await source.collateral_for(QUOTE, {}, PIN)
    assert err.value.reason == "collateral_unreachable"


async def test_response_without_chain_header_is_not_cached(env: Env) -> None:
    async def no_headers(url: str) -> PcsResponse:
        return PcsResponse(body=(SPR / "tcb_info_response.json").read_bytes(), headers={})

    source = PcsCollateralSource("http://pcs.invalid", env.cache, no_headers)
    with pytest.raises(CollateralError) as err:
        await source.collateral_for(QUOTE, {}, PIN)
    assert err.value.reason == "collateral_invalid"


async def test_garbage_quote_is_a_collateral_error(env: Env) -> None:
    with pytest.raises(CollateralError) as err:
        await env.source.collateral_for(b"\x00" * 10, {}, PIN)
    assert err.value.reason == "collateral_quote_unreadable"
