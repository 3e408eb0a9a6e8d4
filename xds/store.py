"""Persistence of mesh state: SQLite, the embedded default.

One small store per aggregate: workloads, revocations, and an append-only event log. ``save``
writes the difference between two states and the events in one transaction (WAL,
synchronous=FULL), so a transition is durable before it is announced and a crash never leaves
half of one behind.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from certs.evidence.claims import Claims, Tee
from xds.state import (
    AttestationRecord,
    Endpoint,
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    QuarantineRecord,
    Registration,
    Revocation,
    Status,
    Trigger,
    WorkloadState,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workloads (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revocations (
    serial TEXT PRIMARY KEY, workload TEXT NOT NULL, not_after TEXT NOT NULL,
    revoked_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, kind TEXT NOT NULL,
    workload TEXT NOT NULL, trigger TEXT, reason TEXT NOT NULL);
"""


class StateStore(Protocol):
    def load(self, trust_domain: str) -> MeshState: ...

    def save(self, old: MeshState, new: MeshState, events: Sequence[Event]) -> None: ...

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]: ...


def _dt(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def claims_to_doc(c: Claims) -> dict[str, Any]:
    return {
        "tee": c.tee.value,
        "measurements": dict(c.measurements),
        "report_data": c.report_data.hex(),
        "debug": c.debug,
        "evidence_sha256": c.evidence_sha256,
        "signer": c.signer,
        "product_id": c.product_id,
        "svn": c.svn,
        "platform_id": c.platform_id,
        "tcb": dict(c.tcb),
        "tcb_status": c.tcb_status,
        "advisories": list(c.advisories),
        "details": dict(c.details),
    }


def claims_from_doc(d: dict[str, Any]) -> Claims:
    return Claims(
        tee=Tee(d["tee"]),
        measurements=dict(d["measurements"]),
        report_data=bytes.fromhex(d["report_data"]),
        debug=bool(d["debug"]),
        evidence_sha256=d["evidence_sha256"],
        signer=d["signer"],
        product_id=d["product_id"],
        svn=d["svn"],
        platform_id=d["platform_id"],
        tcb={k: int(v) for k, v in d["tcb"].items()},
        tcb_status=d["tcb_status"],
        advisories=tuple(d["advisories"]),
        details=dict(d["details"]),
    )


def workload_to_doc(w: WorkloadState) -> dict[str, Any]:
    r = w.registration
    a = w.attestation
    q = w.quarantine
    return {
        "registration": {
            "name": r.name,
            "namespace": r.namespace,
            "service_account": r.service_account,
            "service": r.service,
            "inbound": [r.inbound.address, r.inbound.port],
            "app_port": r.app_port,
            "outbound": dict(r.outbound),
            "labels": dict(r.labels),
            "token_sha256": r.token_sha256,
            "ready": r.ready,
        },
        "status": w.status.value,
        "attestation": None
        if a is None
        else {
            "tee": a.tee,
            "measurements": dict(a.measurements),
            "policy": a.policy,
            "evidence_sha256": a.evidence_sha256,
            "at": a.at.isoformat(),
            "claims": None if a.claims is None else claims_to_doc(a.claims),
        },
        "next_attestation_due": w.next_attestation_due.isoformat()
        if w.next_attestation_due
        else None,
        "certificates": [[str(c.serial), c.not_after.isoformat()] for c in w.certificates],
        "quarantine": None
        if q is None
        else {"trigger": q.trigger.value, "reason": q.reason, "at": q.at.isoformat()},
    }


def workload_from_doc(doc: dict[str, Any]) -> WorkloadState:
    r = doc["registration"]
    a = doc["attestation"]
    q = doc["quarantine"]
    return WorkloadState(
        registration=Registration(
            name=r["name"],
            namespace=r["namespace"],
            service_account=r["service_account"],
            service=r["service"],
            inbound=Endpoint(r["inbound"][0], int(r["inbound"][1])),
            app_port=int(r["app_port"]),
            outbound={k: int(v) for k, v in r["outbound"].items()},
            labels=dict(r["labels"]),
            token_sha256=r["token_sha256"],
            ready=bool(r.get("ready", True)),  # absent in documents written before readiness
        ),
        status=Status(doc["status"]),
        attestation=None
        if a is None
        else AttestationRecord(
            tee=a["tee"],
            measurements=dict(a["measurements"]),
            policy=a["policy"],
            evidence_sha256=a["evidence_sha256"],
            at=datetime.fromisoformat(a["at"]),
            claims=claims_from_doc(a["claims"]) if a.get("claims") else None,
        ),
        next_attestation_due=_dt(doc["next_attestation_due"]),
        certificates=tuple(
            IssuedCert(int(s), datetime.fromisoformat(t)) for s, t in doc["certificates"]
        ),
        quarantine=None
        if q is None
        else QuarantineRecord(Trigger(q["trigger"]), q["reason"], datetime.fromisoformat(q["at"])),
    )


class SqliteStore:
    """The embedded default store. Serial numbers are stored as text (they exceed 64 bits)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def load(self, trust_domain: str) -> MeshState:
        workloads = {
            name: workload_from_doc(json.loads(doc))
            for name, doc in self._db.execute("SELECT name, doc FROM workloads ORDER BY name")
        }
        revocations = tuple(
            Revocation(int(s), datetime.fromisoformat(na), datetime.fromisoformat(ra), w)
            for s, w, na, ra in self._db.execute(
                "SELECT serial, workload, not_after, revoked_at FROM revocations "
                "ORDER BY revoked_at"
            )
        )
        return MeshState(trust_domain, workloads, revocations)

    def save(self, old: MeshState, new: MeshState, events: Sequence[Event]) -> None:
        changed = [w for n, w in new.workloads.items() if old.workloads.get(n) != w]
        removed = [n for n in old.workloads if n not in new.workloads]
        old_rev = {r.serial for r in old.revocations}
        new_rev = {r.serial for r in new.revocations}
        added = [r for r in new.revocations if r.serial not in old_rev]
        dropped = old_rev - new_rev
        if not (changed or removed or added or dropped or events):
            return
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.executemany(
                "INSERT INTO workloads(name, doc) VALUES(?, ?) "
                "ON CONFLICT(name) DO UPDATE SET doc = excluded.doc",
                [
                    (w.registration.name, json.dumps(workload_to_doc(w), sort_keys=True))
                    for w in changed
                ],
            )
            cur.executemany("DELETE FROM workloads WHERE name = ?", [(n,) for n in removed])
            cur.executemany(
                "INSERT OR REPLACE INTO revocations VALUES(?, ?, ?, ?)",
                [
                    (str(r.serial), r.workload, r.not_after.isoformat(), r.revoked_at.isoformat())
                    for r in added
                ],
            )
            cur.executemany(
                "DELETE FROM revocations WHERE serial = ?", [(str(s),) for s in dropped]
            )
            cur.executemany(
                "INSERT INTO events(at, kind, workload, trigger, reason) VALUES(?, ?, ?, ?, ?)",
                [
                    (
                        e.at.isoformat(),
                        e.kind.value,
                        e.workload,
                        e.trigger.value if e.trigger else None,
                        e.reason,
                    )
                    for e in events
                ],
            )
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        query = "SELECT at, kind, workload, trigger, reason FROM events"
        args: tuple[Any, ...] = ()
        if workload is not None:
            query += " WHERE workload = ?"
            args = (workload,)
        query += " ORDER BY id DESC LIMIT ?"
        rows = self._db.execute(query, (*args, limit)).fetchall()
        return [
            Event(EventKind(k), w, datetime.fromisoformat(at), reason, Trigger(t) if t else None)
            for at, k, w, t, reason in reversed(rows)
        ]
