"""Persistence of mesh state: row-granular batches, group commit, SQLite the embedded default.

The seam is ``StateStore``: a caller hands the store a ``Batch`` (the rows a transition changed:
workloads upserted or deleted, revocations added or pruned, events) and waits for it to be
durable before it announces anything. Nothing is written but the rows in the batch.

- ``SqliteStore.write`` commits one batch in one transaction (WAL, synchronous=FULL) on the
  caller's thread and returns None: it is durable when the call returns.
- ``GroupCommitStore`` wraps a ``SqliteStore`` for an asyncio program: ``write`` only enqueues
  (microseconds on the event loop) and returns a future. One writer thread takes everything
  waiting, writes it in one transaction with one fsync, then resolves the futures in submission
  order. The loop never waits for the disk; one fsync covers every batch that queued behind the
  previous one.

``xds.store_pg.PostgresStore`` (several replicas on one database) is the other backend of the
same seam: ``Batch`` carries rows, not SQL; the document encoding
(``workload_to_doc``/``workload_from_doc``), the encoded rows (``_Rows``) and the migration list
shape are shared, and ``GroupCommitStore`` drives either (``CommitBackend``).

Schema changes are ordered ``Migration``s recorded in a ``schema_version`` table, applied at open
in one transaction; a database written by newer code is refused (``StoreError``). The event log
is bounded (the newest ``max_events`` rows are kept, pruned inside the write transaction), and
the database files are created 0600 (they hold registration token hashes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from certs.errors import AttestmeshError
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
    Revocations,
    Status,
    TcbDeferral,
    Trigger,
    WorkloadState,
)

__all__ = [
    "SCHEMA_VERSION",
    "SQLITE_MIGRATIONS",
    "Batch",
    "CommitBackend",
    "CountedBackend",
    "GroupCommitStore",
    "Migration",
    "SqliteStore",
    "StateStore",
    "StoreConflict",
    "StoreError",
    "StoreReader",
    "StoreStats",
    "claims_from_doc",
    "claims_to_doc",
    "diff",
    "merge",
    "migrate",
    "schema_version",
    "workload_from_doc",
    "workload_to_doc",
]

DEFAULT_MAX_EVENTS = 10_000


class StoreError(AttestmeshError):
    """The store cannot do what was asked: its schema is newer than this code
    (``store_schema_too_new``), a migration failed and was rolled back
    (``store_migration_failed``), a commit failed and was rolled back (``store_commit_failed``),
    a batch cannot be encoded (``store_batch_invalid``), or the store is closed
    (``store_closed``)."""


class StoreConflict(StoreError):
    """A batch's ``expect`` did not hold: another writer changed those rows first. Nothing of
    the batch was applied; ``current`` holds the stored rows of every expected name now."""

    def __init__(self, current: Mapping[str, WorkloadState | None]) -> None:
        super().__init__(
            "store_conflict",
            "changed by another writer since this decision read them: "
            + ", ".join(sorted(current)),
        )
        self.current = dict(current)


# ---------------------------------------------------------------------------------------------
# The change set


@dataclass(frozen=True, slots=True)
class Batch:
    """The rows one transition (or several) changed.

    Within one batch, deletes apply after upserts and ``unrevoked`` after ``revoked`` (a name in
    both ``upserts`` and ``deletes`` ends deleted). Batches apply in the order they are written;
    a later batch's row replaces an earlier one's (``merge`` computes the same net effect).

    ``expect`` makes the batch a decision taken on rows read earlier (by this replica, from its
    memory): it applies only if, inside the committing transaction, every named workload's
    stored row is still the one given (None: no row), else nothing of it is applied and its
    writer gets ``StoreConflict`` with the rows stored now. Several replicas deciding about one
    workload are so serialised by the database: the second decision, taken on a row the first
    changed, is refused instead of overwriting it.
    """

    upserts: Mapping[str, WorkloadState] = field(default_factory=dict)  # name -> new row
    deletes: frozenset[str] = frozenset()  # workload names removed
    revoked: tuple[Revocation, ...] = ()  # revocations added
    unrevoked: frozenset[int] = frozenset()  # serials pruned from the CRL
    events: tuple[Event, ...] = ()
    expect: Mapping[str, WorkloadState | None] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.upserts or self.deletes or self.revoked or self.unrevoked or self.events)


def merge(batches: Iterable[Batch]) -> Batch:
    """One batch with the net effect of ``batches`` applied in order (the later row wins)."""
    rows: dict[str, WorkloadState | None] = {}
    revs: dict[int, Revocation | None] = {}
    events: list[Event] = []
    expect: dict[str, WorkloadState | None] = {}
    for b in batches:
        for name, w in b.expect.items():  # later ones are about rows the merge itself wrote
            if name not in rows and name not in expect:
                expect[name] = w
        rows.update(b.upserts)
        rows.update(dict.fromkeys(b.deletes))
        revs.update((r.serial, r) for r in b.revoked)
        revs.update(dict.fromkeys(b.unrevoked))
        events.extend(b.events)
    return Batch(
        upserts={n: w for n, w in rows.items() if w is not None},
        deletes=frozenset(n for n, w in rows.items() if w is None),
        revoked=tuple(r for r in revs.values() if r is not None),
        unrevoked=frozenset(s for s, r in revs.items() if r is None),
        events=tuple(events),
        expect=expect,
    )


def diff(old: MeshState, new: MeshState, events: Sequence[Event] = ()) -> Batch:
    """The batch that turns ``old`` into ``new`` (O(N): compares every workload; a caller that
    knows what it changed builds the ``Batch`` directly)."""
    upserts: dict[str, WorkloadState] = {}
    deletes: frozenset[str] = frozenset()
    if old.workloads is not new.workloads:
        before = old.workloads
        for name, w in new.workloads.items():
            o = before.get(name)
            if o is not w and o != w:
                upserts[name] = w
        deletes = frozenset(n for n in before if n not in new.workloads)
    revoked: tuple[Revocation, ...] = ()
    unrevoked: frozenset[int] = frozenset()
    if new.revocations.extends(old.revocations):  # (the usual case: what was added)
        revoked = new.revocations[len(old.revocations) :]
    else:
        old_rev = old.revocations.serials()
        new_rev = new.revocations.serials()
        revoked = tuple(r for r in new.revocations if r.serial not in old_rev)
        unrevoked = frozenset(old_rev - new_rev)
    return Batch(upserts, deletes, revoked, unrevoked, tuple(events))


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was opened (for metrics; monotonic except ``queued``)."""

    commits: int = 0  # transactions committed (each one fsync of the WAL)
    batches: int = 0  # batches made durable
    rows: int = 0  # rows written (workloads + revocations + events)
    failed_commits: int = 0  # transactions rolled back
    commit_seconds: float = 0.0  # wall time inside committed transactions, fsync included
    max_group: int = 0  # most batches covered by one commit
    queued: int = 0  # batches waiting for the writer now (GroupCommitStore)
    conflicts: int = 0  # batches refused because the rows they expected had changed


class StateStore(Protocol):
    def load(self, trust_domain: str) -> MeshState: ...

    def write(self, batch: Batch) -> asyncio.Future[None] | None:
        """Persist ``batch``; None means it is already durable, else await the future."""
        ...

    def save(self, old: MeshState, new: MeshState, events: Sequence[Event]) -> None:
        """``write(diff(old, new, events))``, durable when it returns."""
        ...

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]: ...

    def close(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


class StoreReader(Protocol):
    """A second connection for reads while a writer thread owns the first."""

    def load(self, trust_domain: str) -> MeshState: ...

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]: ...

    def close(self) -> None: ...


class CommitBackend(Protocol):
    """What ``GroupCommitStore`` drives from its writer thread: ``SqliteStore`` or
    ``xds.store_pg.PostgresStore``."""

    @property
    def where(self) -> str:
        """The database, for messages (no credentials)."""
        ...

    def commit_group(self, group: Sequence[_Rows]) -> list[StoreConflict | None]: ...

    def stats(self) -> StoreStats: ...

    def reader(self) -> StoreReader: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Documents: one JSON document per workload row


_TEE = {t.value: t for t in Tee}
_STATUS = {s.value: s for s in Status}
_TRIGGER = {t.value: t for t in Trigger}
_KIND = {k.value: k for k in EventKind}
_from_iso = datetime.fromisoformat


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
    # The document is fresh from json.loads: its dicts are ours, no copy needed.
    return Claims(
        tee=_TEE[d["tee"]],
        measurements=d["measurements"],
        report_data=bytes.fromhex(d["report_data"]),
        debug=bool(d["debug"]),
        evidence_sha256=d["evidence_sha256"],
        signer=d["signer"],
        product_id=d["product_id"],
        svn=d["svn"],
        platform_id=d["platform_id"],
        tcb=d["tcb"],
        tcb_status=d["tcb_status"],
        advisories=tuple(d["advisories"]),
        details=d["details"],
    )


def workload_to_doc(w: WorkloadState) -> dict[str, Any]:
    r = w.registration
    a = w.attestation
    q = w.quarantine
    doc: dict[str, Any] = {
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
            "pod_uid": r.pod_uid,
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
        else {
            "trigger": q.trigger.value,
            "reason": q.reason,
            "at": q.at.isoformat(),
            "code": q.code,
            "platform": q.platform,
        },
    }
    d = w.tcb_deferral
    if d is not None:  # absent otherwise: rows without one read as before (schema 4)
        doc["tcb_deferral"] = {
            "due": d.due.isoformat(),
            "evidence_sha256": d.evidence_sha256,
            "reason": d.reason,
            "code": d.code,
            "revoked": d.revoked,
        }
    return doc


def workload_from_doc(doc: dict[str, Any]) -> WorkloadState:
    """Direct construction from a document fresh from ``json.loads`` (start-up loads every row:
    no copies of dicts the decoder just made, enum members by dict lookup)."""
    r = doc["registration"]
    a = doc["attestation"]
    q = doc["quarantine"]
    inbound = r["inbound"]
    due = doc["next_attestation_due"]
    d = doc.get("tcb_deferral")  # absent: none (and in documents written before schema 4)
    return WorkloadState(
        registration=Registration(
            name=r["name"],
            namespace=r["namespace"],
            service_account=r["service_account"],
            service=r["service"],
            inbound=Endpoint(inbound[0], int(inbound[1])),
            app_port=int(r["app_port"]),
            outbound=r["outbound"],
            labels=r["labels"],
            token_sha256=r["token_sha256"],
            ready=bool(r.get("ready", True)),  # absent in documents written before readiness
            pod_uid=r.get("pod_uid"),  # absent in documents written before pod binding
        ),
        status=_STATUS[doc["status"]],
        attestation=None
        if a is None
        else AttestationRecord(
            tee=a["tee"],
            measurements=a["measurements"],
            policy=a["policy"],
            evidence_sha256=a["evidence_sha256"],
            at=_from_iso(a["at"]),
            claims=claims_from_doc(a["claims"]) if a.get("claims") else None,
        ),
        next_attestation_due=_from_iso(due) if due else None,
        certificates=tuple(IssuedCert(int(s), _from_iso(t)) for s, t in doc["certificates"]),
        quarantine=None
        if q is None
        else QuarantineRecord(
            _TRIGGER[q["trigger"]],
            q["reason"],
            _from_iso(q["at"]),
            q.get("code", ""),  # absent in documents written before typed reasons
            bool(q.get("platform", False)),
        ),
        tcb_deferral=None
        if d is None
        else TcbDeferral(
            _from_iso(d["due"]), d["evidence_sha256"], d["reason"], d["code"], bool(d["revoked"])
        ),
    )


# Compact, in to_doc's (deterministic) key order; its documents are fresh trees (no cycles).
_encode_doc = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


# ---------------------------------------------------------------------------------------------
# Schema


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step; ``statements`` run in order inside the opening transaction."""

    version: int
    description: str
    statements: tuple[str, ...]


SQLITE_MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "workloads, revocations and the event log",
        (
            "CREATE TABLE IF NOT EXISTS workloads (name TEXT PRIMARY KEY, doc TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS revocations (serial TEXT PRIMARY KEY, "
            "workload TEXT NOT NULL, not_after TEXT NOT NULL, revoked_at TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            "at TEXT NOT NULL, kind TEXT NOT NULL, workload TEXT NOT NULL, trigger TEXT, "
            "reason TEXT NOT NULL)",
        ),
    ),
    Migration(
        2,
        "index the event log by workload (the API's per-workload history)",
        ("CREATE INDEX IF NOT EXISTS events_by_workload ON events(workload, id)",),
    ),
    Migration(
        3,
        "typed reasons on events: the reason code and whether the platform failed",
        (
            "ALTER TABLE events ADD COLUMN code TEXT NOT NULL DEFAULT ''",
            "ALTER TABLE events ADD COLUMN platform INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    Migration(
        4,
        "workload documents may carry a deferred TCB quarantine (tcb_deferral: its deadline); "
        "no DDL: the version keeps older code, which would drop the field when it rewrites a "
        "row, from opening the database",
        (),
    ),
)
SCHEMA_VERSION = SQLITE_MIGRATIONS[-1].version


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    row = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
    return row.fetchone() is not None


def schema_version(db: sqlite3.Connection) -> int:
    """The schema version of an open database: 0 if empty; 1 for a database written before
    versioning (it has the workloads table but no ``schema_version``)."""
    if _has_table(db, "schema_version"):
        row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0
    return 1 if _has_table(db, "workloads") else 0


def migrate(
    db: sqlite3.Connection, migrations: Sequence[Migration] = SQLITE_MIGRATIONS, where: str = ""
) -> int:
    """Bring the schema up to the last of ``migrations`` in one transaction; return its version.

    Idempotent: a database already there is left untouched. Concurrent openers serialise on the
    write lock (BEGIN IMMEDIATE) and read the version inside it. A database newer than the
    newest migration is refused with ``StoreError('store_schema_too_new')``; a migration that
    fails rolls the whole transaction back (SQLite's DDL is transactional)."""
    latest = migrations[-1].version if migrations else 0
    db.execute("BEGIN IMMEDIATE")
    try:
        current = schema_version(db)
        if current > latest:
            raise StoreError(
                "store_schema_too_new",
                f"{where or 'database'} has schema version {current}; this attestmesh knows "
                f"versions up to {latest}: run the newer attestmesh or restore a backup",
            )
        if current < latest:
            for m in migrations:
                if m.version > current:
                    for statement in m.statements:
                        db.execute(statement)
            db.execute(
                "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, "
                "applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)"
            )
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version(version) VALUES(?)", (latest,))
        db.execute("COMMIT")
    except BaseException as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise StoreError(
                "store_migration_failed", f"{where or 'database'}: {type(exc).__name__}: {exc}"
            ) from exc
        raise
    return latest


# ---------------------------------------------------------------------------------------------
# SQLite


def _private_file(path: Path) -> None:
    """Create the database file 0600 before SQLite opens it (SQLite gives the -wal and -shm
    files it creates the database file's mode); tighten files that already exist."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm", "-journal"):
        try:
            side = path.with_name(path.name + suffix)
            if side.stat().st_mode & 0o077:
                side.chmod(0o600)
        except FileNotFoundError:
            pass


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA busy_timeout=10000")
    # switching a fresh file to WAL takes an exclusive lock without waiting on busy_timeout:
    # several processes opening it together (replicas starting at once) retry for up to 10 s
    for attempt in range(200):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 199:
                db.close()
                raise
            time.sleep(0.05)
    db.execute("PRAGMA synchronous=FULL")
    return db


def _load(db: sqlite3.Connection, trust_domain: str) -> MeshState:
    loads = json.loads
    rows = db.execute("SELECT name, doc FROM workloads ORDER BY name").fetchall()
    workloads = {name: workload_from_doc(loads(doc)) for name, doc in rows}
    revocations = Revocations(
        Revocation(int(s), _from_iso(na), _from_iso(ra), w)
        for s, w, na, ra in db.execute(
            "SELECT serial, workload, not_after, revoked_at FROM revocations ORDER BY revoked_at"
        )
    )
    return MeshState(trust_domain, workloads, revocations)


def _events(db: sqlite3.Connection, workload: str | None, limit: int) -> list[Event]:
    if workload is None:
        cursor = db.execute(
            "SELECT at, kind, workload, trigger, reason, code, platform FROM events "
            "ORDER BY id DESC LIMIT ?",
            (limit,),
        )
    else:
        cursor = db.execute(
            "SELECT at, kind, workload, trigger, reason, code, platform FROM events "
            "WHERE workload = ? "
            "ORDER BY id DESC LIMIT ?",
            (workload, limit),
        )
    rows = cursor.fetchall()
    return [
        Event(_KIND[k], w, _from_iso(at), reason, _TRIGGER[t] if t else None, code, bool(p))
        for at, k, w, t, reason, code, p in reversed(rows)
    ]


_EventRow = tuple[str, str, str, str | None, str, str, int]
_RevocationRow = tuple[str, str, str, str]


class DocCache:
    """The last document encoded for each of up to ``size`` workloads, with the state object
    it encodes: a state encoded again (the expected row of a workload's next write is the
    state its last write upserted) is the same object, and its document is reused (one
    ``workload_to_doc`` + JSON, ~30 us, saved per renewal). Keyed by identity, so a state equal
    but not identical is encoded anew; the held object keeps its identity from being reused.
    One thread's (the writer's): not locked."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._docs: dict[str, tuple[WorkloadState, str]] = {}

    def encode(self, name: str, w: WorkloadState) -> str:
        hit = self._docs.get(name)
        if hit is not None and hit[0] is w:
            return hit[1]
        doc = _encode_doc(workload_to_doc(w))
        if self._size:
            self._docs.pop(name, None)  # the newest last: the oldest go first
            self._docs[name] = (w, doc)
            if len(self._docs) > self._size:
                del self._docs[next(iter(self._docs))]
        return doc


@dataclass(slots=True)
class _Rows:
    """Encoded net rows of one or more batches: name -> document (None: delete), serial ->
    revocation row (None: delete), events in order."""

    workloads: dict[str, str | None] = field(default_factory=dict)
    revocations: dict[str, _RevocationRow | None] = field(default_factory=dict)
    events: list[_EventRow] = field(default_factory=list)
    expect: dict[str, str | None] = field(default_factory=dict)  # name -> document (None: none)

    @classmethod
    def encode(cls, batch: Batch, docs: DocCache | None = None) -> _Rows:
        """Serialise a batch (before any SQL runs: a batch that cannot be encoded fails alone).
        ``docs``: documents encoded before, by state object (an expected row is most often the
        very state the previous write of that workload upserted)."""
        try:
            return cls._encode(batch, docs or DocCache(0))
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise StoreError("store_batch_invalid", f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def _encode(cls, batch: Batch, docs: DocCache) -> _Rows:
        # the expected rows first: the cache holds the state the last write upserted
        expect = {n: None if w is None else docs.encode(n, w) for n, w in batch.expect.items()}
        workloads: dict[str, str | None] = {}
        for name, w in batch.upserts.items():
            if w.registration.name != name:
                raise StoreError(
                    "store_batch_invalid",
                    f"upsert key {name!r} is not the workload's name {w.registration.name!r}",
                )
            workloads[name] = docs.encode(name, w)
        workloads.update(dict.fromkeys(batch.deletes))
        revocations: dict[str, _RevocationRow | None] = {
            str(r.serial): (
                str(r.serial),
                r.workload,
                r.not_after.isoformat(),
                r.revoked_at.isoformat(),
            )
            for r in batch.revoked
        }
        revocations.update(dict.fromkeys(str(s) for s in batch.unrevoked))
        events = [
            (
                e.at.isoformat(),
                e.kind.value,
                e.workload,
                e.trigger.value if e.trigger else None,
                e.reason,
                e.code,
                int(e.platform),
            )
            for e in batch.events
        ]
        return cls(workloads, revocations, events, expect)

    def absorb(self, later: _Rows) -> None:
        self.workloads.update(later.workloads)
        self.revocations.update(later.revocations)
        self.events.extend(later.events)

    def count(self) -> int:
        return len(self.workloads) + len(self.revocations) + len(self.events)


def _canonical(doc: str) -> str:
    """A stored document as this code encodes it (documents written by older code lack fields
    that decode to defaults; tuples and lists encode alike)."""
    return _encode_doc(workload_to_doc(workload_from_doc(json.loads(doc))))


def expected_names(group: Sequence[_Rows]) -> list[str]:
    return sorted({n for rows in group for n in rows.expect})


def decide_group(
    stored: Mapping[str, str | None], group: Sequence[_Rows]
) -> tuple[_Rows, list[StoreConflict | None], int]:
    """Which batches of ``group`` apply, in order, given the stored documents of every expected
    name (read inside the committing transaction, the rows locked): a batch applies if its
    expectations hold against the rows as the earlier applied batches left them. Returns the
    merged rows to write, per batch None or its conflict, and how many apply. Pure."""
    view = {n: stored.get(n) for n in expected_names(group)}
    merged = _Rows()
    outcomes: list[StoreConflict | None] = []
    applied = 0
    for rows in group:
        bad = [n for n, want in rows.expect.items() if not _same_doc(view.get(n), want)]
        if bad:
            outcomes.append(
                StoreConflict(
                    {
                        n: None if (d := view.get(n)) is None else workload_from_doc(json.loads(d))
                        for n in rows.expect
                    }
                )
            )
            continue
        merged.absorb(rows)
        for n, doc in rows.workloads.items():
            if n in view:
                view[n] = doc
        outcomes.append(None)
        applied += 1
    return merged, outcomes, applied


def _same_doc(stored: str | None, want: str | None) -> bool:
    if stored is None or want is None:
        return stored is want
    return stored == want or _canonical(stored) == want


class CountedBackend:
    """What both backends (``SqliteStore``, ``xds.store_pg.PostgresStore``) share: the counters
    behind ``stats`` (plain attributes, written by the committing thread; ``stats`` snapshots
    them) and the batch entry points over the backend's ``commit_group``."""

    def __init__(self) -> None:
        self.commits = 0
        self.batches = 0
        self.rows = 0
        self.failed_commits = 0
        self.commit_seconds = 0.0
        self.max_group = 0
        self.conflicts = 0

    def commit_group(self, group: Sequence[_Rows]) -> list[StoreConflict | None]:
        raise NotImplementedError

    def stats(self) -> StoreStats:
        return StoreStats(
            self.commits,
            self.batches,
            self.rows,
            self.failed_commits,
            self.commit_seconds,
            self.max_group,
            conflicts=self.conflicts,
        )

    def _count_commit(
        self, rows: _Rows, outcomes: Sequence[StoreConflict | None], applied: int, started: float
    ) -> None:
        """A transaction committed ``applied`` of ``outcomes``' batches, writing ``rows``;
        ``started``: its ``time.perf_counter()`` at the start."""
        self.commits += 1
        self.batches += applied
        self.rows += rows.count()
        self.commit_seconds += time.perf_counter() - started
        self.max_group = max(self.max_group, applied)
        self.conflicts += len(outcomes) - applied

    def write(self, batch: Batch) -> None:
        """Commit ``batch`` in one transaction; durable when this returns (``StoreConflict``:
        its expectations did not hold, nothing applied)."""
        if not batch.empty():
            (conflict,) = self.commit_group([_Rows.encode(batch)])
            if conflict is not None:
                raise conflict

    def write_group(self, batches: Sequence[Batch]) -> list[StoreConflict | None]:
        """Commit several batches, applied in order, in one transaction (one fsync); per batch
        None (applied) or its conflict."""
        return self.commit_group([_Rows.encode(b) for b in batches])

    def save(self, old: MeshState, new: MeshState, events: Sequence[Event]) -> None:
        self.write(diff(old, new, events))


class SqliteStore(CountedBackend):
    """The embedded default store: one connection, synchronous commits.

    Serial numbers are stored as text (they exceed 64 bits). Not for concurrent use from several
    threads: wrap it in ``GroupCommitStore`` (which then owns it) for an asyncio program.
    ``max_events`` bounds the event log (the newest rows are kept); it is pruned inside a write
    transaction whenever more than ``prune_slack`` rows (default 1% of ``max_events``) are over
    the bound, so the log holds at most ``max_events + prune_slack`` rows after any commit.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        prune_slack: int | None = None,
        migrations: Sequence[Migration] = SQLITE_MIGRATIONS,
    ) -> None:
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        super().__init__()
        self.path = path
        self.max_events = max_events
        self.prune_slack = max_events // 100 if prune_slack is None else prune_slack
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _private_file(path)
        self._db = _connect(path)
        try:
            self.version = migrate(self._db, migrations, where=str(path))
        except BaseException:
            self._db.close()
            raise
        self._pruned_below = 0  # event ids <= this are known to be gone
        self._outcomes: list[StoreConflict | None] = []  # of the last commit_group

    @property
    def where(self) -> str:
        return str(self.path)

    def close(self) -> None:
        self._db.close()

    def reader(self) -> StoreReader:
        """A read-only second connection (WAL readers never wait for the writer)."""
        return _SqliteReader(self.path)

    def load(self, trust_domain: str) -> MeshState:
        return _load(self._db, trust_domain)

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        return _events(self._db, workload, limit)

    def commit_group(self, group: Sequence[_Rows]) -> list[StoreConflict | None]:
        """Commit encoded batches in one transaction, each only if its expectations hold
        (``decide_group``); the caller owns this connection."""
        if not any(r.count() or r.expect for r in group):
            return [None] * len(group)
        self._outcomes = []
        self._commit(group)
        return self._outcomes

    def _commit(self, group: Sequence[_Rows]) -> None:
        """The transaction of ``commit_group`` (its outcomes in ``_outcomes``)."""
        started = time.perf_counter()
        cur = self._db.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")  # the write lock: nobody changes a row read below
            stored: dict[str, str | None] = {}
            names = expected_names(group)
            for i in range(0, len(names), 500):
                chunk = names[i : i + 500]
                marks = ",".join("?" * len(chunk))
                stored.update(
                    cur.execute(
                        f"SELECT name, doc FROM workloads WHERE name IN ({marks})",  # noqa: S608
                        chunk,
                    ).fetchall()
                )
            rows, outcomes, applied = decide_group(stored, group)
            pruned_below = self._write_rows(cur, rows)
            cur.execute("COMMIT")
        except BaseException as exc:
            self._rollback()
            self.failed_commits += 1
            if isinstance(exc, sqlite3.Error):
                raise StoreError("store_commit_failed", f"{type(exc).__name__}: {exc}") from exc
            raise
        self._pruned_below = pruned_below
        self._count_commit(rows, outcomes, applied, started)
        self._outcomes = outcomes

    def _write_rows(self, cur: sqlite3.Cursor, rows: _Rows) -> int:
        """The rows' statements, inside the caller's transaction; returns the new pruning mark."""
        upserts = [(n, d) for n, d in rows.workloads.items() if d is not None]
        deletes = [(n,) for n, d in rows.workloads.items() if d is None]
        revoked = [r for r in rows.revocations.values() if r is not None]
        unrevoked = [(s,) for s, r in rows.revocations.items() if r is None]
        pruned_below = self._pruned_below
        cur.executemany(
            "INSERT INTO workloads(name, doc) VALUES(?, ?) "
            "ON CONFLICT(name) DO UPDATE SET doc = excluded.doc",
            upserts,
        )
        cur.executemany("DELETE FROM workloads WHERE name = ?", deletes)
        cur.executemany("INSERT OR REPLACE INTO revocations VALUES(?, ?, ?, ?)", revoked)
        cur.executemany("DELETE FROM revocations WHERE serial = ?", unrevoked)
        cur.executemany(
            "INSERT INTO events(at, kind, workload, trigger, reason, code, platform) "
            "VALUES(?, ?, ?, ?, ?, ?, ?)",
            rows.events,
        )
        if rows.events:
            last = cur.execute("SELECT last_insert_rowid()").fetchone()[0]
            if last - self.max_events > pruned_below + self.prune_slack:
                pruned_below = last - self.max_events
                cur.execute("DELETE FROM events WHERE id <= ?", (pruned_below,))
        return pruned_below

    def _rollback(self) -> None:
        try:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the connection is unusable; the transaction did not commit either way


class _SqliteReader:
    def __init__(self, path: Path) -> None:
        self._db = _connect(path)
        self._db.execute("PRAGMA query_only=ON")

    def load(self, trust_domain: str) -> MeshState:
        return _load(self._db, trust_domain)

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        return _events(self._db, workload, limit)

    def close(self) -> None:
        self._db.close()


# ---------------------------------------------------------------------------------------------
# Group commit

_Waiter = asyncio.Future[None] | concurrent.futures.Future[None]


@dataclass(slots=True)
class _Pending:
    batch: Batch
    waiter: _Waiter
    loop: asyncio.AbstractEventLoop | None  # None: a concurrent future (``save``)


def _settle(outcomes: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    """On the loop: resolve a group's futures in submission order."""
    for fut, exc in outcomes:
        if fut.done():  # cancelled by its awaiter; the batch is written all the same
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


# Workloads whose last document the writer keeps (~1.5 KB each): the renewals in flight at once
DOC_CACHE_SIZE = 4096


class GroupCommitStore:
    """A ``SqliteStore`` (or ``PostgresStore``) behind one writer thread: group commit for an
    asyncio program.

    ``write`` must be called on the event loop's thread: it puts the batch on a queue the writer
    never locks (p99 about 10 us on the loop, measured by benchmarks/bench_store.py) and returns
    a future. The writer takes every
    batch waiting, encodes each (a batch that cannot be encoded fails alone), commits the rest
    in one transaction (one fsync of the WAL), then resolves their futures in submission order
    with one ``call_soon_threadsafe`` per group. A commit that fails is rolled back and every
    future of the group gets the ``StoreError``; nothing of the group is applied. A future
    resolves only after its batch is durable; cancelling it does not withdraw the batch.

    Reads (``load``, ``events``) use a second connection (``backend.reader()``) and see what
    is durable, not what is still queued; they do not wait for the writer (SQLite: WAL readers
    never block on it; PostgreSQL: MVCC). Their cost is
    on the calling thread: ``events`` is an indexed range of at most ``limit`` rows (well under
    a millisecond); ``load`` decodes every workload row (about 20 us each: ~0.2 s for 10,000),
    meant for start-up, before the loop serves.

    ``close`` stops accepting writes, waits until everything queued is durable (or failed),
    stops the thread and closes both connections. Futures of the last groups are resolved by
    callbacks the loop runs after ``close`` returns.

    Memory is bounded by the callers: each waits for its future, so at most one batch per
    waiting caller is queued. Counters: ``stats()`` (commits = fsyncs, batches, rows, failed
    commits, commit seconds, largest group, queued now).
    """

    def __init__(self, store: CommitBackend, *, thread_name: str = "attestmesh-store") -> None:
        self._store = store
        self._reader = store.reader()
        # The writer blocks on the queue; producers never wait for it (SimpleQueue.put is one
        # C call). The lock only orders producers against close() and is never taken by the
        # writer, so write() never waits for a thread that holds the GIL.
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._put_lock = threading.Lock()
        self._closed = False
        self._attached: list[Closable] = []
        self._docs = DocCache(DOC_CACHE_SIZE)  # the writer thread's
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: Path, **options: Any) -> GroupCommitStore:
        """``GroupCommitStore(SqliteStore(path, **options))``."""
        return cls(SqliteStore(path, **options))

    @property
    def where(self) -> str:
        return self._store.where

    @property
    def backend(self) -> CommitBackend:
        return self._store

    def stats(self) -> StoreStats:
        return replace(self._store.stats(), queued=self._queue.qsize())

    def write(self, batch: Batch) -> asyncio.Future[None] | None:
        """Enqueue ``batch``; the future resolves once it is durable (None: an empty batch)."""
        if batch.empty():
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._enqueue(_Pending(batch, fut, loop))
        return fut

    def save(self, old: MeshState, new: MeshState, events: Sequence[Event]) -> None:
        """Synchronous: enqueue the diff and block the calling thread until it is durable."""
        batch = diff(old, new, events)
        if batch.empty():
            return
        waiter: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._enqueue(_Pending(batch, waiter, None))
        waiter.result()

    def load(self, trust_domain: str) -> MeshState:
        return self._reader.load(trust_domain)

    def events(self, workload: str | None = None, limit: int = 100) -> list[Event]:
        return self._reader.events(workload, limit)

    def attach(self, other: Closable) -> None:
        """Close ``other`` (a change feed following this database, say) first on ``close``."""
        self._attached.append(other)

    def close(self) -> None:
        for other in self._attached:
            other.close()
        self._attached.clear()
        with self._put_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)  # after everything queued: the writer drains, then stops
        self._thread.join()
        self._reader.close()
        self._store.close()

    def _enqueue(self, pending: _Pending) -> None:
        with self._put_lock:
            if self._closed:
                raise StoreError("store_closed", f"{self._store.where} is closed")
            self._queue.put(pending)

    def _run(self) -> None:
        q = self._queue
        stop = False
        while not stop:
            first = q.get()  # blocks (without the GIL) until something is queued
            group: list[_Pending] = []
            item: _Pending | None = first
            while True:  # take everything waiting
                if item is None:
                    stop = True  # close(): nothing can be queued after it
                else:
                    group.append(item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            if group:
                self._write_group(group)

    def _write_group(self, group: list[_Pending]) -> None:
        outcomes: list[tuple[_Pending, BaseException | None]] = []
        encoded: list[tuple[int, _Rows]] = []  # (index in outcomes, rows)
        for p in group:
            try:
                rows = _Rows.encode(p.batch, self._docs)
            except Exception as exc:  # this batch alone fails
                outcomes.append((p, exc))
                continue
            encoded.append((len(outcomes), rows))
            outcomes.append((p, None))
        if encoded:
            try:
                conflicts = self._store.commit_group([rows for _, rows in encoded])
            except Exception as exc:
                outcomes = [(p, exc if e is None else e) for p, e in outcomes]
            else:
                for (i, _), conflict in zip(encoded, conflicts, strict=True):
                    if conflict is not None:
                        outcomes[i] = (outcomes[i][0], conflict)
        self._resolve(outcomes)

    @staticmethod
    def _resolve(outcomes: list[tuple[_Pending, BaseException | None]]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], Any]]] = {}
        for p, exc in outcomes:
            if p.loop is None:
                cf = p.waiter
                assert isinstance(cf, concurrent.futures.Future)
                if exc is None:
                    cf.set_result(None)
                else:
                    cf.set_exception(exc)
            else:
                af = p.waiter
                assert isinstance(af, asyncio.Future)
                per_loop.setdefault(p.loop, []).append((af, exc))
        for loop, items in per_loop.items():
            call: Callable[..., Any] = loop.call_soon_threadsafe
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                call(_settle, items)


if TYPE_CHECKING:  # both stores implement the seam (checked by mypy)

    def _conforms(
        a: SqliteStore, b: GroupCommitStore
    ) -> tuple[StateStore, StateStore, CommitBackend]:
        return a, b, a
