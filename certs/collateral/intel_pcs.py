"""Intel PCS (Provisioning Certification Service) v4 collateral for DCAP quotes, cached on disk.

Endpoints (``base``: the operator's ``--intel-pcs-url``, Intel's is
``https://api.trustedservices.intel.com``):

* TCB info: ``{base}/{sgx|tdx}/certification/v4/tcb?fmspc=<hex>``; issuer chain in the
  ``TCB-Info-Issuer-Chain`` header (URL-encoded PEM; v3 used ``SGX-TCB-Info-Issuer-Chain``).
* QE identity: ``{base}/{sgx|tdx}/certification/v4/qe/identity``; issuer chain in
  ``SGX-Enclave-Identity-Issuer-Chain``.
* PCK CRL: ``{base}/sgx/certification/v4/pckcrl?ca=processor|platform&encoding=der``; issuer
  chain in ``SGX-PCK-CRL-Issuer-Chain``.
* Root CA CRL: not part of the PCS API; ``root_ca_crl_url`` (Intel's certificate site).

Each response (body and the issuer-chain header) is cached as one blob with
``certs.collateral.cache.fetch_cached``; expiry is the document's own ``nextUpdate``. When the
vendor is down a stale entry is served with a warning; with nothing cached, ``CollateralError``.
The names returned are those ``certs.evidence.dcap`` documents.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import aiohttp

from certs.collateral.cache import DiskCache, fetch_cached
from certs.errors import CollateralError, EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Collateral
from certs.evidence.dcap import (
    parse_certificate_chain,
    parse_pck_extension,
    parse_quote,
    split_signed_response,
)
from certs.evidence.x509chain import parse_crl

INTEL_ROOT_CA_CRL_URL = "https://certificates.trustedservices.intel.com/IntelSGXRootCA.der"

TCB_INFO_CHAIN_HEADERS = ("TCB-Info-Issuer-Chain", "SGX-TCB-Info-Issuer-Chain")
QE_IDENTITY_CHAIN_HEADERS = ("SGX-Enclave-Identity-Issuer-Chain",)
PCK_CRL_CHAIN_HEADERS = ("SGX-PCK-CRL-Issuer-Chain",)


@dataclass(frozen=True, slots=True)
class PcsResponse:
    body: bytes
    headers: Mapping[str, str]
    """Header names lower-cased."""


FetchWithHeaders = Callable[[str], Awaitable[PcsResponse]]
"""Fetch a URL's body and headers; raises CollateralError when the vendor is unreachable."""


def http_fetcher_with_headers(
    session: aiohttp.ClientSession, timeout_s: float = 10.0
) -> FetchWithHeaders:
    """An aiohttp adapter that keeps the headers; foreign errors become CollateralError."""

    async def fetch(url: str) -> PcsResponse:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise CollateralError("collateral_http_status", f"{url}: HTTP {resp.status}")
                body = await resp.read()
                headers = {k.lower(): v for k, v in resp.headers.items()}
                return PcsResponse(body=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CollateralError("collateral_unreachable", f"{url}: {exc!r}") from exc

    return fetch


def encode_blob(resp: PcsResponse) -> bytes:
    """One cache blob holding body and headers together."""
    doc = {"headers": dict(resp.headers), "body": base64.b64encode(resp.body).decode()}
    return json.dumps(doc, sort_keys=True).encode()


def decode_blob(blob: bytes) -> PcsResponse:
    try:
        doc = json.loads(blob)
        headers = doc["headers"]
        body = base64.b64decode(doc["body"], validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise CollateralError("collateral_invalid", "corrupt PCS cache blob") from exc
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise CollateralError("collateral_invalid", "corrupt PCS cache blob headers")
    return PcsResponse(body=body, headers=headers)


def _chain(resp: PcsResponse, names: tuple[str, ...], what: str) -> bytes:
    for name in names:
        value = resp.headers.get(name.lower())
        if value:
            pem = urllib.parse.unquote(value).encode()
            try:
                parse_certificate_chain(pem, what)
            except EvidenceVerificationError as exc:
                raise CollateralError("collateral_invalid", f"{what}: bad issuer chain") from exc
            return pem
    raise CollateralError("collateral_invalid", f"{what}: no {names[0]} header")


def _signed_expiry(key: str, chain_headers: tuple[str, ...]) -> Callable[[bytes], datetime]:
    def expiry(blob: bytes) -> datetime:
        resp = decode_blob(blob)
        _chain(resp, chain_headers, key)
        try:
            inner, _sig = split_signed_response(resp.body, key)
            doc = json.loads(inner)
            return datetime.fromisoformat(str(doc["nextUpdate"]).replace("Z", "+00:00"))
        except (EvidenceVerificationError, ValueError, KeyError, TypeError) as exc:
            raise CollateralError("collateral_invalid", f"{key}: unreadable response") from exc

    return expiry


def _crl_expiry(chain_headers: tuple[str, ...] | None) -> Callable[[bytes], datetime]:
    def expiry(blob: bytes) -> datetime:
        resp = decode_blob(blob)
        if chain_headers is not None:
            _chain(resp, chain_headers, "pck_crl")
        crl = parse_crl(
            resp.body, lambda detail: CollateralError("collateral_invalid", f"CRL: {detail}")
        )
        next_update = crl.next_update
        if next_update is None:
            raise CollateralError("collateral_invalid", "CRL without nextUpdate")
        return next_update

    return expiry


@dataclass(frozen=True, slots=True)
class QuoteFacts:
    """What collateral selection needs from a quote: TEE, FMSPC and the PCK issuing CA."""

    tee: str
    fmspc: str
    ca: str


def quote_facts(evidence: bytes) -> QuoteFacts:
    try:
        quote = parse_quote(evidence)
        certs = parse_certificate_chain(quote.signature.pck_chain_pem, "PCK chain")
        pck = parse_pck_extension(certs[0])
    except (EvidenceFormatError, EvidenceVerificationError) as exc:
        raise CollateralError("collateral_quote_unreadable", f"{exc.reason}: {exc.detail}") from exc
    issuer = certs[0].issuer_text
    return QuoteFacts(
        tee="tdx" if quote.is_tdx else "sgx",
        fmspc=pck.fmspc.hex().upper(),
        ca="processor" if "Processor" in issuer else "platform",
    )


class PcsCollateralSource:
    """Fills in the DCAP collateral a quote needs that the caller did not supply."""

    def __init__(
        self,
        base_url: str,
        cache: DiskCache,
        fetch: FetchWithHeaders,
        *,
        root_ca_crl_url: str = INTEL_ROOT_CA_CRL_URL,
        max_age: timedelta | None = None,
    ) -> None:
        """``max_age`` caps how long a cached document is used before it is fetched again
        (Intel may publish a new TCB info long before the current one's nextUpdate)."""
        self._max_age = max_age
        self._base = base_url.rstrip("/")
        self._cache = cache
        self._fetch = fetch
        self._root_ca_crl_url = root_ca_crl_url

    async def _get(
        self, key: str, url: str, now: datetime, expiry: Callable[[bytes], datetime]
    ) -> PcsResponse:
        async def fetch_blob(u: str) -> bytes:
            return encode_blob(await self._fetch(u))

        def capped(blob: bytes) -> datetime:
            at = expiry(blob)
            return at if self._max_age is None else min(at, now + self._max_age)

        blob = await fetch_cached(self._cache, key, url, fetch_blob, now, capped)
        return decode_blob(blob)

    async def collateral_for(
        self, evidence: bytes, supplied: Collateral, now: datetime
    ) -> dict[str, bytes]:
        """Supplied names win; a supplied ``collateral_json`` is complete on its own."""
        out = dict(supplied)
        if "collateral_json" in out:
            return out
        facts = quote_facts(evidence)
        return await self.platform_collateral(facts.tee, facts.fmspc, facts.ca, now, have=out)

    async def platform_collateral(
        self,
        tee: str,
        fmspc: str,
        ca: str,
        now: datetime,
        *,
        have: Collateral | None = None,
    ) -> dict[str, bytes]:
        """The collateral of one platform (TEE kind, FMSPC, PCK CA) through the cache: what a
        quote of it needs, and what ``attestmesh.tcb_monitor`` re-evaluates claims with."""
        out = dict(have or {})
        base = self._base
        fmspc = fmspc.upper()
        if tee not in ("sgx", "tdx") or ca not in ("processor", "platform"):
            raise CollateralError("collateral_invalid", f"no PCS collateral for {tee}/{ca}")
        if "tcb_info" not in out:
            url = f"{base}/{tee}/certification/v4/tcb?fmspc={fmspc}"
            resp = await self._get(
                f"intel-pcs:{tee}:tcb:{fmspc}",
                url,
                now,
                _signed_expiry("tcbInfo", TCB_INFO_CHAIN_HEADERS),
            )
            out["tcb_info"] = resp.body
            out["tcb_info_issuer_chain"] = _chain(resp, TCB_INFO_CHAIN_HEADERS, "tcb_info")
        if "qe_identity" not in out:
            url = f"{base}/{tee}/certification/v4/qe/identity"
            resp = await self._get(
                f"intel-pcs:{tee}:qe-identity",
                url,
                now,
                _signed_expiry("enclaveIdentity", QE_IDENTITY_CHAIN_HEADERS),
            )
            out["qe_identity"] = resp.body
            out["qe_identity_issuer_chain"] = _chain(resp, QE_IDENTITY_CHAIN_HEADERS, "qe_identity")
        if "pck_crl" not in out:
            url = f"{base}/sgx/certification/v4/pckcrl?ca={ca}&encoding=der"
            resp = await self._get(
                f"intel-pcs:pckcrl:{ca}", url, now, _crl_expiry(PCK_CRL_CHAIN_HEADERS)
            )
            out["pck_crl"] = resp.body
            out["pck_crl_issuer_chain"] = _chain(resp, PCK_CRL_CHAIN_HEADERS, "pck_crl")
        if "root_ca_crl" not in out:
            resp = await self._get(
                "intel-pcs:root-ca-crl", self._root_ca_crl_url, now, _crl_expiry(None)
            )
            out["root_ca_crl"] = resp.body
        return out
