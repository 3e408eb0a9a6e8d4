"""AMD Key Distribution Service (KDS): fetch SEV-SNP endorsement certificates, with a cache.

URLs (``base``: the operator's ``--amd-kds-url``, AMD's is ``https://kdsintf.amd.com``):

- VCEK (DER): ``{base}/vcek/v1/{product}/{hwid}?blSPL=..&teeSPL=..&snpSPL=..&ucodeSPL=..``,
  ``hwid`` = the report's ``chip_id`` in lowercase hex (Turin: its first 8 bytes, and a
  leading ``fmcSPL`` parameter); the SPL values are the report's **reported_tcb**, decimal,
  two digits at least.
- VCEK chain (PEM, ASK then ARK): ``{base}/vcek/v1/{product}/cert_chain``.
- VLEK chain (PEM, ASVK then ARK): ``{base}/vlek/v1/{product}/cert_chain``. The VLEK itself is
  not served by chip id (it is loaded by the cloud provider); it must come with the evidence.

``KdsCollateralSource.collateral_for`` returns the collateral the agent supplied, completed
with what is missing, in the names ``certs.evidence.sev_snp`` documents (``vcek``,
``cert_chain``). Cache entries expire at the certificate's notAfter (optionally capped by
``max_age``); a vendor outage serves a stale entry with a warning (see ``fetch_cached``). The
chain is optional for the verifier (it has pinned intermediates), so a chain that cannot be
fetched is logged and left out rather than failing the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from certs.collateral.cache import DiskCache, Fetch, fetch_cached
from certs.errors import CollateralError, EvidenceFormatError
from certs.evidence.claims import Collateral
from certs.evidence.sev_snp import (
    COLLATERAL_CERT_CHAIN,
    COLLATERAL_VCEK,
    COLLATERAL_VLEK,
    AttestationReport,
    Product,
    SigningKey,
    TcbVersion,
    decode_tcb,
    load_amd_certificate,
    parse_amd_chain,
    parse_evidence,
    product_from_cpuid,
    product_of_certificate,
)
from certs.evidence.x509chain import parse_crl

__all__ = [
    "KdsCollateralSource",
    "cert_chain_url",
    "crl_url",
    "vcek_url",
]

log = logging.getLogger(__name__)


def vcek_url(base_url: str, product: Product, chip_id: bytes, tcb: TcbVersion) -> str:
    """The KDS URL of the VCEK for one chip at one TCB (reported_tcb decoded for product)."""
    hwid = (chip_id[:8] if product is Product.TURIN else chip_id).hex()
    params = []
    if product is Product.TURIN:
        params.append(f"fmcSPL={tcb.fmc or 0:02d}")
    params += [
        f"blSPL={tcb.bootloader:02d}",
        f"teeSPL={tcb.tee:02d}",
        f"snpSPL={tcb.snp:02d}",
        f"ucodeSPL={tcb.microcode:02d}",
    ]
    return f"{base_url.rstrip('/')}/vcek/v1/{product}/{hwid}?{'&'.join(params)}"


def cert_chain_url(base_url: str, product: Product, key: SigningKey) -> str:
    """The KDS URL of the ASK+ARK (VCEK) or ASVK+ARK (VLEK) chain."""
    kind = "vlek" if key is SigningKey.VLEK else "vcek"
    return f"{base_url.rstrip('/')}/{kind}/v1/{product}/cert_chain"


def crl_url(base_url: str, product: Product) -> str:
    """The KDS URL of the product's CRL (revoked ASKs / endorsement keys, signed by the ARK)."""
    return f"{base_url.rstrip('/')}/vcek/v1/{product}/crl"


def _crl_expiry(now: datetime, max_age: timedelta | None) -> Callable[[bytes], datetime]:
    def expiry_of(body: bytes) -> datetime:
        crl = parse_crl(
            body, lambda detail: CollateralError("collateral_invalid", f"CRL from KDS: {detail}")
        )
        next_update = crl.next_update
        if next_update is None:
            raise CollateralError("collateral_invalid", "CRL from KDS has no nextUpdate")
        return _capped(next_update, now, max_age)

    return expiry_of


def _capped(not_after: datetime, now: datetime, max_age: timedelta | None) -> datetime:
    return min(not_after, now + max_age) if max_age is not None else not_after


def _vcek_expiry(now: datetime, max_age: timedelta | None) -> Callable[[bytes], datetime]:
    def expiry_of(body: bytes) -> datetime:
        try:
            cert = load_amd_certificate(body)
        except EvidenceFormatError as exc:
            raise CollateralError("collateral_invalid", f"VCEK from KDS: {exc.detail}") from None
        return _capped(cert.not_valid_after_utc, now, max_age)

    return expiry_of


def _chain_expiry(now: datetime, max_age: timedelta | None) -> Callable[[bytes], datetime]:
    def expiry_of(body: bytes) -> datetime:
        try:
            chain = parse_amd_chain(body)
        except EvidenceFormatError as exc:
            raise CollateralError(
                "collateral_invalid", f"cert_chain from KDS: {exc.detail}"
            ) from None
        not_after = min(chain.ark.not_valid_after_utc, chain.intermediate.not_valid_after_utc)
        return _capped(not_after, now, max_age)

    return expiry_of


class KdsCollateralSource:
    """Complete SNP collateral from AMD KDS through the disk cache.

    ``fallback_products``: products to try, in order, when the report does not name its CPU
    (report version 2 has no CPUID bytes); a 404 from KDS for one product moves to the next.
    """

    def __init__(
        self,
        base_url: str,
        cache: DiskCache,
        fetch: Fetch,
        *,
        fallback_products: Sequence[Product] = (Product.MILAN, Product.GENOA),
        fetch_chain: bool = True,
        max_age: timedelta | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._cache = cache
        self._fetch = fetch
        self._fallback = tuple(fallback_products)
        self._fetch_chain = fetch_chain
        self._max_age = max_age

    async def collateral_for(
        self, evidence: bytes, supplied: Collateral, now: datetime
    ) -> dict[str, bytes]:
        """Return ``supplied`` merged with the fetched ``vcek`` / ``cert_chain``.

        Raises CollateralError (``collateral_missing``: a VLEK or masked chip id that KDS
        cannot serve; ``collateral_unreachable`` / ``collateral_http_status`` /
        ``collateral_invalid``: nothing usable fetched or cached) and EvidenceFormatError for
        evidence that does not parse.
        """
        report, _hcl = parse_evidence(evidence)
        out = dict(supplied)
        products = self._products(report, supplied)
        if report.signing_key is SigningKey.VLEK:
            if COLLATERAL_VLEK not in supplied:
                raise CollateralError(
                    "collateral_missing",
                    "report is signed with a VLEK, which KDS does not serve by chip id; "
                    "the agent must supply it as collateral 'vlek'",
                )
        elif report.signing_key is SigningKey.VCEK:
            if COLLATERAL_VCEK not in supplied:
                product, out[COLLATERAL_VCEK] = await self._vcek(report, products, now)
                products = (product,)
        else:
            raise CollateralError("collateral_missing", "report has no signing key")
        if self._fetch_chain and COLLATERAL_CERT_CHAIN not in supplied and len(products) == 1:
            chain = await self._chain(products[0], report.signing_key, now)
            if chain is not None:
                out[COLLATERAL_CERT_CHAIN] = chain
        return out

    def _products(self, report: AttestationReport, supplied: Collateral) -> tuple[Product, ...]:
        product = product_from_cpuid(report.cpuid)
        cert = supplied.get(str(report.signing_key))
        if product is None and cert is not None:
            try:
                product = product_of_certificate(cert)
            except EvidenceFormatError:
                product = None  # the verifier will say what is wrong with it
        return (product,) if product is not None else self._fallback

    async def _vcek(
        self, report: AttestationReport, products: Sequence[Product], now: datetime
    ) -> tuple[Product, bytes]:
        if report.chip_id_masked:
            raise CollateralError(
                "collateral_missing", "chip_id is masked; KDS cannot serve the VCEK"
            )
        last: CollateralError | None = None
        for product in products:
            url = vcek_url(
                self._base, product, report.chip_id, decode_tcb(report.reported_tcb, product)
            )
            try:
                body = await fetch_cached(
                    self._cache, url, url, self._fetch, now, _vcek_expiry(now, self._max_age)
                )
            except CollateralError as exc:
                last = exc
                if exc.reason == "collateral_http_status":
                    continue  # e.g. 404: not this product
                raise
            return product, body
        raise last or CollateralError("collateral_missing", "no AMD product to ask KDS for")

    async def crl(self, product: Product | str, now: datetime) -> bytes:
        """The product's CRL (``{base}/vcek/v1/{product}/crl``, DER, signed by the ARK) through
        the cache, expiring at its nextUpdate; verified by ``certs.tcb_reeval.verify_amd_crl``."""
        url = crl_url(self._base, Product(product))
        return await fetch_cached(
            self._cache, url, url, self._fetch, now, _crl_expiry(now, self._max_age)
        )

    async def _chain(self, product: Product, key: SigningKey, now: datetime) -> bytes | None:
        url = cert_chain_url(self._base, product, key)
        try:
            return await fetch_cached(
                self._cache, url, url, self._fetch, now, _chain_expiry(now, self._max_age)
            )
        except CollateralError as exc:
            log.warning("no AMD cert_chain for %s %s, using the pinned one: %s", product, key, exc)
            return None
