"""The attested control plane: when the control plane runs in a TEE (SNP/TDX CVM, Nitro, or the
simulated TEE locally) it serves evidence that binds its TLS serving key; a client checks that
evidence against an AttestationPolicy before it trusts the control plane (``attestmesh
verify-controlplane URL --policy FILE``, the agent's ``--control-plane-policy``).

Protocol (the attestation API port, HTTPS)::

    GET /v1/controlplane/attestation?nonce=<base64url, 32 bytes>
    200 {"tee": ..., "evidence": b64, "collateral": {name: b64}, "certificate_chain": PEM,
         "trust_bundle": PEM}

The evidence's report data is ``certs.binding.expected_report_data(nonce, SPKI)`` of the serving
certificate's key: the same binding a workload uses, with the client's fresh nonce. The client
accepts when (1) the TLS peer certificate it saw is the leaf of ``certificate_chain``, (2) the
evidence verifies to the vendor root and binds its nonce and that key, (3) the policy admits the
claims, (4) the chain leads to ``trust_bundle`` and names the control plane's SPIFFE ID. It then
knows which mesh CA an attested control plane runs: the returned bundle is what agents trust.

Trust on first use is avoided by design: the client does not verify TLS against any CA while
fetching (it has none yet); everything it accepts is vouched for by the evidence. Collecting
evidence is costly on real hardware: the server collects one at a time and at most
``rate`` per second (429 beyond), off the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import http.client
import itertools
import json
import secrets
import ssl
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from aiohttp import web
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization

from certs.binding import NONCE_LEN, binding_matches, expected_report_data
from certs.errors import AttestmeshError
from certs.evidence.claims import Claims, Tee, Verifier
from certs.policy import Admitted, AttestationPolicy, appraise_all

if TYPE_CHECKING:
    from sidecar.agent import Evidence, EvidenceSource

PATH = "/v1/controlplane/attestation"
MAX_RESPONSE = 1 << 20
EXIT_OK, EXIT_REJECTED, EXIT_INVALID = 0, 1, 2


class ControlPlaneAttestationError(AttestmeshError):
    """The control plane's evidence is missing, malformed, not bound to its TLS key, or not
    admitted by the policy. Reasons: ``cp_unreachable``, ``cp_not_attested`` (no evidence
    served), ``cp_response_invalid``, ``cp_key_mismatch``, ``cp_evidence_invalid``,
    ``cp_binding_mismatch``, ``cp_chain_invalid``, ``cp_rejected``, ``cp_bundle_mismatch``,
    ``cp_busy`` (429, retried), ``cp_not_verified`` (the agent's gate is closed)."""


def _spki(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------------------------------
# server side


class SelfAttestation:
    """Serves the control plane's own evidence. ``serving_chain``: the PEM chain (leaf first) of
    the serving certificate new handshakes use; ``trust_bundle``: the mesh root bundle."""

    def __init__(
        self,
        source: EvidenceSource,
        serving_chain: Callable[[], bytes],
        trust_bundle: Callable[[], bytes],
        *,
        rate: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._chain = serving_chain
        self._bundle = trust_bundle
        self._lock = asyncio.Lock()
        self._interval = 1.0 / rate
        self._next = 0.0
        self._clock = clock
        self.served = 0
        self.refused = 0

    def route(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        raw = request.query.get("nonce", "")
        try:
            nonce = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        except (binascii.Error, ValueError):
            nonce = b""
        if len(nonce) != NONCE_LEN or len(raw) > 64:
            self.refused += 1
            return web.json_response(
                {"error": "nonce_invalid", "detail": f"nonce must be {NONCE_LEN} bytes"},
                status=400,
            )
        now = self._clock()
        if self._lock.locked() or now < self._next:
            self.refused += 1
            return web.json_response({"error": "rate_limited", "detail": "retry"}, status=429)
        async with self._lock:
            self._next = now + self._interval
            chain = self._chain()
            leaf = x509.load_pem_x509_certificates(chain)[0]
            spki = _spki(leaf)
            report_data = expected_report_data(nonce, spki)
            try:
                evidence = await asyncio.to_thread(
                    self._source.collect, report_data, nonce=nonce, spki=spki
                )
            except AttestmeshError as exc:
                return web.json_response(
                    {"error": "evidence_unavailable", "detail": exc.detail}, status=503
                )
        self.served += 1
        return web.json_response(
            {
                "tee": evidence.tee,
                "evidence": _b64(evidence.evidence),
                "collateral": {k: _b64(v) for k, v in evidence.collateral.items()},
                "certificate_chain": chain.decode("ascii"),
                "trust_bundle": self._bundle().decode("ascii"),
            }
        )


# ---------------------------------------------------------------------------------------------
# client side: parse (pure) and check (pure), fetch (adapter)


@dataclass(frozen=True, slots=True)
class ServedAttestation:
    tee: str
    evidence: bytes
    collateral: Mapping[str, bytes]
    chain: tuple[x509.Certificate, ...]
    trust_bundle: tuple[x509.Certificate, ...]
    trust_bundle_pem: bytes


def parse_response(body: bytes) -> ServedAttestation:
    """The JSON answer, strictly; ControlPlaneAttestationError(``cp_response_invalid``)."""

    def bad(detail: str) -> ControlPlaneAttestationError:
        return ControlPlaneAttestationError("cp_response_invalid", detail)

    if len(body) > MAX_RESPONSE:
        raise bad(f"answer of {len(body)} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {
        "tee", "evidence", "collateral", "certificate_chain", "trust_bundle",
    }:  # fmt: skip
        raise bad("expected tee, evidence, collateral, certificate_chain, trust_bundle")
    tee, coll = doc["tee"], doc["collateral"]
    if not isinstance(tee, str) or tee not in {t.value for t in Tee}:
        raise bad(f"unknown TEE {tee!r}")
    if not isinstance(coll, dict) or not all(isinstance(k, str) for k in coll):
        raise bad("collateral must map names to base64")

    def unb64(value: Any, what: str) -> bytes:
        if not isinstance(value, str):
            raise bad(f"{what} is not a string")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"{what} is not base64") from None

    def certs(value: Any, what: str) -> tuple[x509.Certificate, ...]:
        if not isinstance(value, str) or "-----BEGIN CERTIFICATE-----" not in value:
            raise bad(f"{what} is not PEM")
        try:
            out = tuple(x509.load_pem_x509_certificates(value.encode("ascii")))
        except (ValueError, UnicodeEncodeError, UnsupportedAlgorithm):
            raise bad(f"{what} holds an unreadable certificate") from None
        return out

    return ServedAttestation(
        tee=tee,
        evidence=unb64(doc["evidence"], "evidence"),
        collateral={k: unb64(v, f"collateral.{k}") for k, v in coll.items()},
        chain=certs(doc["certificate_chain"], "certificate_chain"),
        trust_bundle=certs(doc["trust_bundle"], "trust_bundle"),
        trust_bundle_pem=doc["trust_bundle"].encode("ascii"),
    )


@dataclass(frozen=True, slots=True)
class VerifiedControlPlane:
    claims: Claims
    policy: str
    trust_bundle_pem: bytes
    root_sha256: str
    serving_spiffe_id: str


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def check_attestation(
    served: ServedAttestation,
    *,
    peer_der: bytes,
    nonce: bytes,
    verifiers: Mapping[Tee, Verifier],
    policies: Sequence[AttestationPolicy],
    spiffe_id: str,
    now: datetime,
) -> VerifiedControlPlane:
    """Decide whether the served evidence makes this TLS peer an attested control plane."""
    leaf = served.chain[0]
    if leaf.public_bytes(serialization.Encoding.DER) != peer_der:
        raise ControlPlaneAttestationError(
            "cp_key_mismatch", "the TLS peer is not the certificate the evidence is bound to"
        )
    verifier = verifiers.get(Tee(served.tee))
    if verifier is None:
        raise ControlPlaneAttestationError("cp_evidence_invalid", f"no verifier for {served.tee}")
    try:
        claims = verifier.verify(served.evidence, now=now, collateral=served.collateral)
    except AttestmeshError as exc:
        raise ControlPlaneAttestationError(
            "cp_evidence_invalid", f"{exc.reason}: {exc.detail}"
        ) from exc
    if not binding_matches(claims.report_data, nonce, _spki(leaf)):
        raise ControlPlaneAttestationError(
            "cp_binding_mismatch",
            "the evidence does not bind this request's nonce and the serving key",
        )
    decision = appraise_all(claims, policies, now)
    if not isinstance(decision, Admitted):
        raise ControlPlaneAttestationError("cp_rejected", "; ".join(decision.reasons))
    # the serving chain: leaf <- intermediate(s) <- a root of the served bundle
    path = list(served.chain)
    for child, parent in itertools.pairwise(path):
        if not _signed_by(child, parent):
            raise ControlPlaneAttestationError("cp_chain_invalid", "the chain is not a path")
    roots = [r for r in served.trust_bundle if _signed_by(path[-1], r) or r == path[-1]]
    if not roots:
        raise ControlPlaneAttestationError(
            "cp_chain_invalid", "the serving chain does not lead to the served trust bundle"
        )
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if spiffe_id not in uris:
        raise ControlPlaneAttestationError(
            "cp_chain_invalid", f"the serving certificate does not name {spiffe_id}"
        )
    return VerifiedControlPlane(
        claims=claims,
        policy=decision.policy,
        trust_bundle_pem=served.trust_bundle_pem,
        root_sha256=roots[0].fingerprint(hashes.SHA256()).hex(),
        serving_spiffe_id=spiffe_id,
    )


def fetch_attestation(url: str, nonce: bytes, *, timeout_s: float = 10.0) -> tuple[bytes, bytes]:
    """(the TLS peer's certificate DER, the answer body). TLS is not verified against a CA
    here on purpose: the evidence is what authenticates the peer (``check_attestation``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ControlPlaneAttestationError("cp_unreachable", f"{url!r} is not an https URL")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # authenticated by the evidence, see above
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    conn = http.client.HTTPSConnection(
        parts.hostname, parts.port or 443, timeout=timeout_s, context=ctx
    )
    query = urllib.parse.urlencode({"nonce": base64.urlsafe_b64encode(nonce).rstrip(b"=")})
    try:
        conn.request("GET", f"{parts.path.rstrip('/')}{PATH}?{query}")
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        peer = sock.getpeercert(binary_form=True)
        resp = conn.getresponse()
        body = resp.read(MAX_RESPONSE + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise ControlPlaneAttestationError("cp_unreachable", f"{url}: {exc!r}") from None
    finally:
        conn.close()
    if resp.status == 404:
        raise ControlPlaneAttestationError(
            "cp_not_attested", f"{url} serves no evidence of its own (not started in a TEE?)"
        )
    if resp.status == 429:
        raise ControlPlaneAttestationError("cp_busy", f"{url} is collecting other evidence")
    if resp.status != 200:
        raise ControlPlaneAttestationError("cp_unreachable", f"{url}: HTTP {resp.status}")
    if not peer:
        raise ControlPlaneAttestationError("cp_unreachable", "no TLS peer certificate")
    return peer, body


def verify_controlplane(
    url: str,
    *,
    verifiers: Mapping[Tee, Verifier],
    policies: Sequence[AttestationPolicy],
    spiffe_id: str,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    nonce: Callable[[], bytes] = lambda: secrets.token_bytes(NONCE_LEN),
    attempts: int = 4,
    pause: Callable[[float], None] = time.sleep,
) -> VerifiedControlPlane:
    """Fetch with a fresh nonce and check. Retried with a short pause: a busy server (it
    collects one evidence at a time), and a key mismatch (the serving certificate may have
    rotated between the handshake and the answer)."""
    for attempt in range(attempts):
        n = nonce()
        try:
            peer, body = fetch_attestation(url, n)
            return check_attestation(
                parse_response(body), peer_der=peer, nonce=n, verifiers=verifiers,
                policies=policies, spiffe_id=spiffe_id, now=now(),
            )  # fmt: skip
        except ControlPlaneAttestationError as exc:
            if exc.reason not in ("cp_busy", "cp_key_mismatch") or attempt == attempts - 1:
                raise
            pause(0.25 * (attempt + 1))
    raise AssertionError("unreachable")


def require_bundle(verified: VerifiedControlPlane, bundle_pem: bytes) -> None:
    """The agent's ``--ca-bundle`` must be the bundle of the attested control plane."""
    mine = {c.fingerprint(hashes.SHA256()) for c in x509.load_pem_x509_certificates(bundle_pem)}
    theirs = {
        c.fingerprint(hashes.SHA256())
        for c in x509.load_pem_x509_certificates(verified.trust_bundle_pem)
    }
    if not mine & theirs:
        raise ControlPlaneAttestationError(
            "cp_bundle_mismatch",
            "the attested control plane's mesh CA is not the one in --ca-bundle",
        )


class ControlPlaneGate:
    """The agent's ``--control-plane-policy``: evidence leaves the workload only while the
    control plane it talks to has been verified (at most ``max_age`` ago) and runs the mesh CA
    of the agent's ``--ca-bundle``. ``check`` verifies every control-plane URL; it runs on a
    worker thread (``refresh``), never in ``collect``."""

    def __init__(
        self,
        check: Callable[[], Sequence[VerifiedControlPlane]],
        bundle_pem: bytes,
        *,
        max_age: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._bundle = bundle_pem
        self._max_age = max_age
        self._clock = clock
        self._verified_at: float | None = None
        self.last_error: ControlPlaneAttestationError | None = None

    def verified(self) -> bool:
        at = self._verified_at
        return at is not None and self._clock() - at <= self._max_age

    async def refresh(self) -> bool:
        try:
            results = await asyncio.to_thread(self._check)
            for verified in results:
                require_bundle(verified, self._bundle)
        except ControlPlaneAttestationError as exc:
            self._verified_at = None
            self.last_error = exc
            return False
        self._verified_at = self._clock()
        self.last_error = None
        return True

    async def run(self, stop: asyncio.Event, interval: float = 300.0) -> None:
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval if self.verified() else 5.0)

    def guard(self, source: EvidenceSource) -> GatedSource:
        return GatedSource(source, self)


class GatedSource:
    """An EvidenceSource that refuses to collect for an unverified control plane."""

    def __init__(self, source: EvidenceSource, gate: ControlPlaneGate) -> None:
        self._source = source
        self._gate = gate

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        if not self._gate.verified():
            why = self._gate.last_error
            raise ControlPlaneAttestationError(
                "cp_not_verified",
                "the control plane does not satisfy --control-plane-policy"
                + (f" ({why.reason}: {why.detail})" if why is not None else " (not checked yet)"),
            )
        return self._source.collect(report_data, nonce=nonce, spki=spki)


# ---------------------------------------------------------------------------------------------
# CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "verify-controlplane",
        help="check that a control plane runs in a TEE its policy admits",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("url", help="the control plane's attestation API, https://host:port")
    p.add_argument("--policy", type=Path, required=True, help="AttestationPolicy YAML")
    p.add_argument("--trust-domain", default="attestmesh.local")
    p.add_argument("--roots", type=Path, help="vendor roots directory (default: bundled)")
    p.add_argument("--sim-platform-key", type=Path, action="append",
                   help="accept the simulated TEE of this platform public key (PEM)")  # fmt: skip
    p.add_argument("--ca-out", type=Path, help="write the attested mesh CA bundle here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def load_checker(
    policy_file: Path, roots: Path | None, sim_keys: Sequence[Path]
) -> tuple[dict[Tee, Verifier], tuple[AttestationPolicy, ...]]:
    import yaml

    from certs.collateral.roots import load_roots
    from certs.evidence.composite import attach_gpus
    from certs.evidence.registry import build_verifiers
    from certs.evidence.sim import load_platform_public_key
    from certs.policy import parse_policies

    try:
        docs = list(yaml.safe_load_all(policy_file.read_text()))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise AttestmeshError("usage", f"cannot read {policy_file}: {exc}") from None
    policies = parse_policies([d for d in docs if d is not None])
    keys = [load_platform_public_key(p.read_bytes()) for p in sim_keys]
    verifiers = attach_gpus(build_verifiers(load_roots(roots), sim_keys=keys or None))
    return verifiers, policies


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from attestmesh.serve import control_plane_spiffe_id

    verifiers, policies = load_checker(args.policy, args.roots, args.sim_platform_key or ())
    spiffe_id = control_plane_spiffe_id(args.trust_domain)
    try:
        verified = verify_controlplane(
            args.url, verifiers=verifiers, policies=policies, spiffe_id=spiffe_id
        )
    except ControlPlaneAttestationError as exc:
        code = EXIT_REJECTED if exc.reason == "cp_rejected" else EXIT_INVALID
        if args.json:
            json.dump({"verified": False, "reason": exc.reason, "detail": exc.detail}, out)
            out.write("\n")
        else:
            out.write(f"NOT VERIFIED: {exc.reason}: {exc.detail}\n")
        return code
    if args.ca_out is not None:
        args.ca_out.write_bytes(verified.trust_bundle_pem)
    c = verified.claims
    report = {
        "verified": True,
        "tee": c.tee.value,
        "policy": verified.policy,
        "measurements": dict(c.measurements),
        "tcb_status": c.tcb_status,
        "mesh_root_sha256": verified.root_sha256,
        "serving_identity": verified.serving_spiffe_id,
    }
    if args.json:
        json.dump(report, out, sort_keys=True)
        out.write("\n")
    else:
        out.write(f"verified: {args.url} runs in {c.tee.value}, admitted by {verified.policy}\n")
        out.write(f"mesh root SHA-256 {verified.root_sha256}\n")
        for k, v in sorted(c.measurements.items()):
            out.write(f"  {k} {v}\n")
    return EXIT_OK


def add_self_arguments(cp: argparse.ArgumentParser) -> None:
    """``attestmesh controlplane``: serve the control plane's own evidence."""
    g = cp.add_argument_group(
        "attested control plane",
        f"serve evidence of this control plane's TEE, bound to its serving key, at {PATH}",
    )
    g.add_argument("--self-tee", choices=["sim", "sev-snp", "tsm", "nitro"],
                   help="the TEE this control plane runs in")  # fmt: skip
    g.add_argument("--self-device", type=Path, help="override the TEE device path")
    g.add_argument("--self-sim-platform-key", type=Path, help="sim: platform private key")
    g.add_argument("--self-sim-measurement", help="sim: the measurement to report (96 hex)")


def self_source_from_args(args: argparse.Namespace) -> EvidenceSource | None:
    if getattr(args, "self_tee", None) is None:
        return None
    from attestmesh.agent_cmd import _source

    return _source(
        argparse.Namespace(
            tee=args.self_tee,
            device=args.self_device,
            sim_platform_key=args.self_sim_platform_key,
            sim_measurement=args.self_sim_measurement,
        )
    )


def add_gate_arguments(a: argparse.ArgumentParser) -> None:
    """``attestmesh agent``: verify the control plane before sending it evidence."""
    g = a.add_argument_group(
        "attested control plane",
        "send evidence only to a control plane whose own evidence the policy admits",
    )
    g.add_argument("--control-plane-policy", type=Path, help="AttestationPolicy YAML")
    g.add_argument("--control-plane-trust-domain", default="attestmesh.local")
    g.add_argument("--control-plane-roots", type=Path, help="vendor roots (default: bundled)")
    g.add_argument(
        "--control-plane-sim-platform-key",
        type=Path,
        action="append",
        help="accept a simulated control plane of this platform key (tests)",
    )


def gate_from_args(args: argparse.Namespace, bundle_pem: bytes) -> ControlPlaneGate | None:
    if getattr(args, "control_plane_policy", None) is None:
        return None
    from attestmesh.serve import control_plane_spiffe_id

    verifiers, policies = load_checker(
        args.control_plane_policy,
        args.control_plane_roots,
        args.control_plane_sim_platform_key or (),
    )
    urls = [u.strip() for u in str(args.control_plane).split(",") if u.strip()]
    spiffe_id = control_plane_spiffe_id(args.control_plane_trust_domain)

    def check() -> list[VerifiedControlPlane]:
        return [
            verify_controlplane(u, verifiers=verifiers, policies=policies, spiffe_id=spiffe_id)
            for u in urls
        ]

    return ControlPlaneGate(check, bundle_pem)
