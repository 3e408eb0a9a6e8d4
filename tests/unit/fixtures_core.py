"""Shared builders for the attestation/issuance core tests (claims, policy documents, CSRs,
mesh state). Plain functions, no pytest magic, so unit and component tests can both use them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.evidence.claims import Claims, Tee
from certs.policy import API_VERSION
from xds.state import AttestationRecord, Endpoint, Registration

NOW = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
MEASUREMENT = bytes(range(48))
MEASUREMENT_HEX = MEASUREMENT.hex()
OTHER_MEASUREMENT = bytes(range(1, 49))
TRUST_DOMAIN = "mesh.example"


def claims(tee: Tee = Tee.SIM, **overrides: Any) -> Claims:
    """Claims that the default ``policy_doc`` admits, with any field overridden."""
    base = Claims(
        tee=tee,
        measurements={"measurement": MEASUREMENT_HEX},
        report_data=bytes(64),
        debug=False,
        evidence_sha256="ab" * 32,
    )
    return replace(base, **overrides)


def policy_doc(
    name: str = "pol",
    namespace: str = "default",
    *,
    service_accounts: list[str] | None = None,
    tees: list[str] | None = None,
    refs: Mapping[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """An AttestationPolicy document; by default it admits sim evidence with MEASUREMENT."""
    body: dict[str, Any] = {
        "selector": {"serviceAccounts": service_accounts or ["web"]},
        "allowedTees": tees if tees is not None else ["sim"],
        "referenceValues": dict(refs)
        if refs is not None
        else {"sim": {"measurement": [MEASUREMENT_HEX]}},
    }
    body.update(spec)
    return {
        "apiVersion": API_VERSION,
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def csr_pem(key: Any) -> bytes:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def registration(
    name: str = "web-1",
    *,
    namespace: str = "default",
    service_account: str = "web",
    service: str = "web",
    port: int = 15001,
    labels: Mapping[str, str] | None = None,
    token_sha256: str | None = None,
) -> Registration:
    return Registration(
        name=name,
        namespace=namespace,
        service_account=service_account,
        service=service,
        inbound=Endpoint("127.0.0.1", port),
        app_port=8080,
        outbound={},
        labels=dict(labels or {}),
        token_sha256=token_sha256,
    )


def record(
    tee: str = "sim",
    measurements: Mapping[str, str] | None = None,
    at: datetime = NOW,
) -> AttestationRecord:
    return AttestationRecord(
        tee=tee,
        measurements=dict(measurements or {"measurement": MEASUREMENT_HEX}),
        policy="default/pol",
        evidence_sha256="ab" * 32,
        at=at,
    )


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


# ---------------------------------------------------------------------------------------------
# A real control plane on temporary state (component tests)


class Clock:
    """An injectable, settable clock."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


class RecordingPublisher:
    """Records every announcement the control plane makes, in order."""

    def __init__(self) -> None:
        self.published: list[tuple[Any, tuple[Any, ...], Any]] = []
        self.events: list[Any] = []

    def publish(self, state: Any, mesh_policies: Any, trust: Any, changed: Any = None) -> None:
        self.published.append((state, tuple(mesh_policies), trust))

    def on_events(self, state: Any, events: Any) -> None:
        self.events.extend(events)

    @property
    def last_state(self) -> Any:
        return self.published[-1][0]

    @property
    def last_trust(self) -> Any:
        return self.published[-1][2]


def make_control_plane(
    directory: Any,
    *,
    clock: Clock,
    platform_key: ec.EllipticCurvePrivateKey,
    policies: list[dict[str, Any]] | None = None,
    registrations: list[Registration] | None = None,
    sim: bool = True,
    publisher: RecordingPublisher | None = None,
    collateral_sources: Mapping[Tee, Any] | None = None,
) -> Plane:
    """A ControlPlane over SqliteStore/CertificateAuthority in ``directory``. Calling it again on
    the same directory is a restart: state and CA are loaded, not created."""
    import secrets

    from attestmesh.controlplane import ControlPlane
    from attestmesh.metrics import Metrics
    from certs.ca import CertificateAuthority
    from certs.evidence.sim import SimVerifier
    from certs.policy import parse_policies
    from xds.store import SqliteStore

    metrics = Metrics()
    publisher = publisher or RecordingPublisher()
    store = SqliteStore(directory / "state.db")
    ca = CertificateAuthority.load_or_create(directory / "ca", TRUST_DOMAIN, clock())
    verifiers: dict[Tee, Any] = {Tee.SIM: SimVerifier([platform_key.public_key()])} if sim else {}
    cp = ControlPlane(
        state=store.load(TRUST_DOMAIN),
        store=store,
        ca=ca,
        verifiers=verifiers,
        policies=parse_policies(policies if policies is not None else [policy_doc()]),
        mesh_policies=(),
        metrics=metrics,
        publisher=publisher,
        clock=clock,
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
        collateral_sources=collateral_sources,
    )
    if registrations:
        cp.register(registrations)
    return Plane(cp, store, metrics, publisher, ca)


@dataclass
class Plane:
    cp: Any
    store: Any
    metrics: Any
    publisher: RecordingPublisher
    ca: Any

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)

    def rejections(self, endpoint: str, reason: str) -> float:
        return self.sample("attestmesh_api_rejections_total", endpoint=endpoint, reason=reason)

    @property
    def issued(self) -> float:
        return self.sample("attestmesh_certificates_issued_total")
