"""A small attested mesh (frontend -> backend) for builder, server and benchmark tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from xds.build import TrustMaterial
from xds.meshpolicy import HttpMatch, MeshPolicy, Rule, Source
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    record_attestation,
    register,
)

TD = "mesh.test"
NOW = datetime(2025, 6, 1, tzinfo=UTC)
TRUST = TrustMaterial(b"-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n", b"crl")


def reg(
    name: str, port: int, outbound: dict[str, int] | None = None, service: str = ""
) -> Registration:
    return Registration(
        name, "default", name, service or name, Endpoint("127.0.0.1", port), port + 1000,
        outbound or {},
    )  # fmt: skip


def attested(state: MeshState, r: Registration, serial: int) -> MeshState:
    state, _ = register(state, r, NOW)
    state, _ = record_attestation(
        state,
        r.name,
        AttestationRecord("sim", {}, "p", "00", NOW),
        IssuedCert(serial, NOW + timedelta(hours=1)),
        NOW + timedelta(hours=1),
        NOW,
    )
    return state


def allow(dest: str, caller: str, *to: HttpMatch) -> MeshPolicy:
    rule = Rule((Source(namespace="default", service_account=caller),), None, tuple(to))
    return MeshPolicy(f"{caller}-to-{dest}", "default", dest, (rule,))


def two_workloads() -> MeshState:
    state = MeshState(TD)
    state = attested(state, reg("frontend", 15001, {"backend": 16001}), 1)
    return attested(state, reg("backend", 15002, {"frontend": 16002}), 2)


def many_callers(n: int) -> MeshState:
    """``n`` clients calling one backend service served by two replicas."""
    state = MeshState(TD)
    state = attested(state, reg("backend-0", 20000, service="backend"), 1)
    state = attested(state, reg("backend-1", 20001, service="backend"), 2)
    for i in range(n):
        state = attested(state, reg(f"client-{i}", 30000 + i, {"backend": 40000}), 10 + i)
    return state
